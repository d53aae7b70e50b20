"""Wraps Debian's system libraries as Bazel cc_library targets.

Link flags come from pkg-config when the repository is fetched, so the build follows whatever
versions of gRPC, Protobuf, Abseil and spdlog the machine has. Headers live under /usr/include,
which the auto-configured toolchain already treats as a builtin include directory.

Libraries that Debian also ships as static archives (Abseil, Protobuf, gRPC and their deps) are
linked statically: loading ~40 shared objects and relocating them cost the launcher ~15 ms at
every start, a third of its start-up budget (measured in the session that made the change, by
bench/launcher_bench.py before and after). spdlog and fmt stay shared.
"""

_LIB_DIR = "/usr/lib/x86_64-linux-gnu"

_PKG_CONFIG_LIBS = {
    "absl": ["absl_status", "absl_statusor", "absl_strings", "absl_str_format"],
    "crypto": ["libcrypto"],
    "grpc": ["grpc++", "protobuf"],
    "protobuf": ["protobuf"],
    "sodium": ["libsodium"],
    "spdlog": ["spdlog"],
    "zlib": ["zlib"],
}

def _pkg_config(ctx, what, modules):
    result = ctx.execute(["pkg-config", what] + modules)
    if result.return_code != 0:
        fail("pkg-config %s %s failed (run scripts/setup.sh): %s" % (what, " ".join(modules), result.stderr))
    return result.stdout.strip().split(" ") if result.stdout.strip() else []

def _prefer_static(ctx, flags):
    """-lfoo becomes -l:libfoo.a where the archive exists; duplicates dropped, order kept."""
    out = []
    static = []
    for flag in flags:
        if flag.startswith("-l") and ctx.path("%s/lib%s.a" % (_LIB_DIR, flag[2:])).exists:
            archive = "-l:lib%s.a" % flag[2:]
            if archive not in static:
                static.append(archive)
        elif flag not in out:
            out.append(flag)
    if not static:
        return out
    return ["-Wl,--start-group"] + static + ["-Wl,--end-group"] + out

def _starlark_list(items):
    return "[" + ", ".join(['"%s"' % item for item in items]) + "]"

def _system_libs_impl(ctx):
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, modules in _PKG_CONFIG_LIBS.items():
        cflags = _pkg_config(ctx, "--cflags", modules)
        defines = [flag[2:] for flag in cflags if flag.startswith("-D")]
        linkopts = _prefer_static(ctx, _pkg_config(ctx, "--libs", modules))
        build.append("cc_library(name = \"%s\", defines = %s, linkopts = %s)" % (
            name,
            _starlark_list(defines),
            _starlark_list(linkopts),
        ))

    # Header-only libraries: nothing to link, the target documents the dependency.
    build.append('cc_library(name = "cli11")')
    build.append('cc_library(name = "doctest")')

    ctx.file("BUILD", "\n".join(build) + "\n")
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
    environ = ["PKG_CONFIG_PATH"],
)
