"""Project-wide C++ rule wrappers: our code compiles with -Wall -Wextra -Werror."""

HAP_COPTS = ["-Wall", "-Wextra", "-Werror"]

def hap_cc_library(name, copts = [], **kwargs):
    native.cc_library(name = name, copts = HAP_COPTS + copts, **kwargs)

def hap_cc_binary(name, copts = [], **kwargs):
    native.cc_binary(name = name, copts = HAP_COPTS + copts, **kwargs)

def hap_cc_test(name, copts = [], deps = [], **kwargs):
    native.cc_test(
        name = name,
        copts = HAP_COPTS + copts,
        deps = deps + ["//third_party:gtest_main"],
        **kwargs
    )

def hap_proto_library(name, srcs, grpc_srcs = [], deps = [], visibility = None):
    """Generates C++ (and gRPC) code with the system protoc; one cc_library.

    Protos are compiled relative to the package directory, so `proto/hap/v1/x.proto`
    is imported as "hap/v1/x.proto" and its header is included as "hap/v1/x.pb.h".
    """
    pkg = native.package_name()
    outs = []
    for s in srcs:
        base = s[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
    for s in grpc_srcs:
        base = s[:-len(".proto")]
        outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs,
        cmd = ("protoc -I{pkg} --cpp_out=$(RULEDIR) {srcs} && " +
               "protoc -I{pkg} --grpc_out=$(RULEDIR) " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin {gsrcs}").format(
            pkg = pkg,
            srcs = " ".join([pkg + "/" + s for s in srcs]),
            gsrcs = " ".join([pkg + "/" + s for s in grpc_srcs]),
        ),
    )
    # Messages only (protobuf): what the planner core may depend on.
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".pb.cc") and not o.endswith(".grpc.pb.cc")],
        hdrs = [o for o in outs if o.endswith(".pb.h") and not o.endswith(".grpc.pb.h")],
        includes = ["."],
        deps = deps + ["//third_party:protobuf"],
        visibility = visibility,
    )

    # Service stubs (gRPC): for the service layer and clients.
    native.cc_library(
        name = name + "_grpc",
        srcs = [o for o in outs if o.endswith(".grpc.pb.cc")],
        hdrs = [o for o in outs if o.endswith(".grpc.pb.h")],
        includes = ["."],
        deps = [":" + name, "//third_party:grpc"],
        visibility = visibility,
    )

# --- CUDA ---------------------------------------------------------------

# Target compatibility for CUDA code: built only under --config=cuda.
CUDA_ONLY = select({
    "//build_defs/cuda:enabled": [],
    "//conditions:default": ["//build_defs/cuda:cuda_toolkit_required"],
})

# GPU architectures compiled to SASS (comma list, --define=hap_cuda_archs=..;
# default in .bazelrc: T4, A100, A10/L4, L40/4090, H100/H200), plus PTX of the
# last one so newer GPUs JIT it.
_GENCODE_SH = ("gencode=; last=; for a in $$(echo $(hap_cuda_archs) | tr , ' '); do " +
               "gencode=\"$$gencode -gencode=arch=compute_$$a,code=sm_$$a\"; last=$$a; done; " +
               "gencode=\"$$gencode -gencode=arch=compute_$$last,code=compute_$$last\"; ")

def hap_cuda_library(name, srcs, hdrs = [], cu_deps_hdrs = [], deps = [], copts = [], **kwargs):
    """Compiles .cu files with nvcc (one genrule each) into a cc_library.

    The .cu files see the workspace root on the include path (`#include
    "executor/cuda/x.h"`) and the CUDA headers; keep them free of Abseil and
    protobuf (plain C++17 + CUDA). `hdrs` are the library's public headers;
    `cu_deps_hdrs` other headers the .cu files include.
    """
    objs = []
    for src in srcs:
        obj = "_objs_cuda/" + name + "/" + src.replace(".cu", ".o")
        native.genrule(
            name = name + "_nvcc_" + src.replace("/", "_").replace(".", "_"),
            srcs = [src] + hdrs + cu_deps_hdrs + ["@local_cuda//:headers"],
            outs = [obj],
            tools = ["@local_cuda//:nvcc"],
            cmd = (_GENCODE_SH + "$(location @local_cuda//:nvcc) -std=c++17 -O3 -lineinfo " +
                   "-Xcompiler=-fPIC,-Wall -Werror=all-warnings " +
                   "--expt-relaxed-constexpr $$gencode " +
                   "-I. -I$(GENDIR) -c $(location %s) -o $@") % src,
            target_compatible_with = CUDA_ONLY,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        copts = HAP_COPTS + copts,
        deps = deps + ["@local_cuda//:cuda"],
        target_compatible_with = CUDA_ONLY,
        **kwargs
    )
