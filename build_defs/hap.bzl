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
