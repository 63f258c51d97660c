"""@local_cuda: the CUDA toolkit (headers, cudart, cuBLAS, NCCL, nvcc) found on
this machine, or an empty stand-in where there is none.

Looks at $HAP_CUDA_PATH, else /usr/local/cuda. With a toolkit, the repository
exposes `:cuda` (headers + link flags) and `:nvcc`; without one, `:cuda` is an
empty library and `:nvcc` a script that fails naming what is missing. The
CUDA targets are only built under `--config=cuda` (build_defs/cuda/BUILD.bazel),
so a machine without CUDA builds everything else.
"""

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("HAP_CUDA_PATH", "/usr/local/cuda")
    found = (ctx.path(root + "/bin/nvcc").exists and
             ctx.path(root + "/include/cuda_runtime.h").exists)
    if found:
        ctx.symlink(root + "/include", "include")
        # A wrapper, not a symlink: nvcc finds its own headers next to where
        # it really lives.
        ctx.file("nvcc", "#!/bin/sh\nexec {root}/bin/nvcc \"$@\"\n".format(root = root), executable = True)
        lib = root + "/lib64"
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])
exports_files(["nvcc"])
cc_library(
    name = "cuda",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh", "include/**/*.inl"]),
    includes = ["include"],
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lcublas", "-lcudart", "-lnccl", "-ldl", "-lpthread"],
)
filegroup(name = "headers", srcs = glob(["include/**"]))
""".format(lib = lib))
    else:
        ctx.file("nvcc", "#!/bin/sh\necho 'nvcc not found under {root} (set HAP_CUDA_PATH)' >&2\nexit 1\n".format(root = root), executable = True)
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])
exports_files(["nvcc"])
cc_library(name = "cuda")
filegroup(name = "headers", srcs = [])
""")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["HAP_CUDA_PATH"],
    local = True,
)
