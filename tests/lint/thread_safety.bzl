"""Clang's thread-safety analysis over sources that Bazel's gcc toolchain compiles.

gcc ignores ABSL_GUARDED_BY and ABSL_EXCLUSIVE_LOCKS_REQUIRED; clang checks them. This rule runs
Debian's clang++ with -fsyntax-only over each source, with the include paths, defines and
headers (generated ones included) of the cc_library targets in `deps`, and writes a report: its
first line is PASS or FAIL, the rest clang's diagnostics. The action itself always succeeds, so
that a violation shows up as the test's failure with the diagnostics in its log.
"""

THREAD_SAFETY_FLAGS = [
    "-std=c++17",
    "-fsyntax-only",
    "-Wthread-safety",
    "-Wthread-safety-beta",
    "-Werror=thread-safety",
    "-Werror=thread-safety-beta",
]

def _thread_safety_report_impl(ctx):
    contexts = [dep[CcInfo].compilation_context for dep in ctx.attr.deps]
    headers = depset(transitive = [c.headers for c in contexts])
    defines = depset(transitive = [c.defines for c in contexts]).to_list()
    includes = depset(transitive = [c.includes for c in contexts]).to_list()
    quote = depset(transitive = [c.quote_includes for c in contexts]).to_list()
    system = depset(transitive = [c.system_includes for c in contexts]).to_list()
    flags = list(THREAD_SAFETY_FLAGS)
    flags += ["-D" + d for d in defines]
    flags += ["-iquote" + i for i in quote]
    flags += ["-I" + i for i in includes]
    flags += ["-isystem" + i for i in system]
    report = ctx.actions.declare_file(ctx.label.name + ".txt")
    ctx.actions.run_shell(
        inputs = depset(ctx.files.srcs, transitive = [headers]),
        outputs = [report],
        command = """
set -u
out="$1"; shift
flags=()
while [ "$1" != "--" ]; do flags+=("$1"); shift; done
shift
status=PASS
log=$(mktemp)
for src in "$@"; do
  if ! clang++ "${flags[@]}" "$src" >>"$log" 2>&1; then status=FAIL; echo "FAIL: $src" >>"$log"; fi
done
{ echo "$status"; cat "$log"; } >"$out"
rm -f "$log"
""",
        arguments = [report.path] + flags + ["--"] + [f.path for f in ctx.files.srcs],
        mnemonic = "ThreadSafety",
        progress_message = "Checking locks with clang -Wthread-safety in %d files" % len(ctx.files.srcs),
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([report]), runfiles = ctx.runfiles(files = [report]))]

thread_safety_report = rule(
    implementation = _thread_safety_report_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cc"]),
        "deps": attr.label_list(providers = [CcInfo]),
    },
)
