"""LibTorch from PyTorch's own wheel (torch==2.11.0, CUDA build), as the repository @torch.

scripts/setup.sh installs the wheel into a virtual environment under ~/.cache/elrun and links it
from the checkout as .venv; this rule finds torch/ and the NVIDIA wheels beside it in that
environment's site-packages and serves:
  @torch//:torch       the C++ API, c10d and Gloo; links libtorch_cuda too (--no-as-needed), so
                       every binary has the CUDA kernels and NCCL registered, as Python's torch does;
                       runs on machines without a GPU.
  @torch//:torch_cuda  CUDA runtime and NCCL headers (the wheel's own, the versions libtorch was
                       built with), USE_C10D_NCCL and the CUDA runtime library: only for the few
                       files that name CUDA streams, events, graphs, the caching allocator or
                       ProcessGroupNCCL.
The wheel's libraries carry no RUNPATH to the NVIDIA wheels (Python preloads them), so binaries
get an RPATH to torch/lib and to each NVIDIA library folder. On another machine (the GPU host)
LD_LIBRARY_PATH pointing at that machine's torch/lib and nvidia/*/lib takes precedence only if
the RPATH folders are absent there, which they are (scripts/gpu_check.sh).
"""

# The NVIDIA wheels' library folders that libtorch_cuda's NEEDED entries resolve to.
_NVIDIA_LIB_DIRS = ["cu13/lib", "cudnn/lib", "cusparselt/lib", "nccl/lib", "nvshmem/lib"]

def _torch_wheel_impl(ctx):
    workspace = ctx.path(Label("@//:WORKSPACE")).dirname
    venv = ctx.os.environ.get("ELRUN_TORCH_VENV", "%s/.venv" % workspace)
    found = ctx.execute(["sh", "-c", "realpath -e \"$1\"/lib/python3*/site-packages/torch/include/torch/script.h", "-", venv])
    if found.return_code != 0 or not found.stdout.strip():
        fail("LibTorch not found under %s (run scripts/setup.sh, which installs torch==2.11.0 there)" % venv)
    torch_dir = found.stdout.strip()[:-len("/include/torch/script.h")]
    site = torch_dir[:-len("/torch")]
    ctx.symlink(torch_dir + "/include", "include")
    ctx.symlink(site + "/nvidia/cu13/include", "cuda_include")
    ctx.symlink(site + "/nvidia/nccl/include", "nccl_include")

    lib_dirs = [torch_dir + "/lib"] + ["%s/nvidia/%s" % (site, d) for d in _NVIDIA_LIB_DIRS]
    rpath = ["-Wl,-rpath,%s" % d for d in lib_dirs]
    rpath_link = ["-Wl,-rpath-link,%s" % d for d in lib_dirs]
    # libtorch and libtorch_cpu export copies of std::filesystem (e.g. remove_all) that crash when
    # called from outside; naming libstdc++ first puts it ahead of them in the lookup order, so
    # the binaries' own calls bind to libstdc++'s.
    linkopts = ["-L%s/lib" % torch_dir] + rpath + rpath_link + [
        "-Wl,--no-as-needed",
        "-lstdc++",
        "-ltorch",
        "-ltorch_cuda",
        "-ltorch_cpu",
        "-lc10_cuda",
        "-lc10",
        "-Wl,--as-needed",
        "-pthread",
    ]
    # c10's CUDA guards and events are inline and call the runtime directly; the wheel ships only
    # the versioned soname, which the GPU host's torch 2.11 (cu130) wheel has too.
    cudart = ["-L%s/nvidia/cu13/lib" % site, "-l:libcudart.so.13"]
    build = """package(default_visibility = ["//visibility:public"])

cc_library(
    name = "torch",
    hdrs = glob(["include/**"], exclude = ["include/pybind11/**", "include/google/**"]),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = ["USE_DISTRIBUTED", "USE_C10D_GLOO"],
    linkopts = %s,
)

cc_library(
    name = "torch_cuda",
    hdrs = glob(["cuda_include/**", "nccl_include/**"]),
    includes = ["cuda_include", "nccl_include"],
    defines = ["USE_C10D_NCCL"],
    linkopts = %s,
    deps = [":torch"],
)
""" % (repr(linkopts), repr(cudart))
    ctx.file("BUILD", build)
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("torch_dir.txt", torch_dir + "\n")

torch_wheel = repository_rule(
    implementation = _torch_wheel_impl,
    local = True,
    environ = ["ELRUN_TORCH_VENV"],
)
