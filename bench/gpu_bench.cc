// GPU benchmarks (scripts/gpu-check.sh runs them; CUDA builds only):
//
//   gpu_bench gemm [--shapes 4096x4096x4096,...] [--iters 20] [--device N]
//     y[M,N] = x[M,K] w[N,K]^T in float32: our "linear" kernel on the CUDA
//     device (exact fp32, and with TF32 allowed) against cuBLAS called
//     directly on the same buffers: cublasSgemm (fp32) and cublasGemmEx with
//     TF32 tensor cores, and with bf16 inputs (the GPU's dense peak for
//     reference). Each is timed with cudaEvents over --iters calls after
//     3 warm-up calls. One JSON line per shape and kind:
//       {"shape": "MxNxK", "kind": "ours_fp32", "seconds": s, "tflops": t}
//
//   gpu_bench step --model gpt [--steps 20] [--warmup 3] [--device N]
//                  --NAME VALUE ...
//     Our training step on cuda:N: the zoo model (every --NAME VALUE other
//     than the flags is a zoo parameter) lowered as the 1-rank program,
//     SGD with momentum (lr 0.01, momentum 0.9) as bench/step_worker.cc and
//     bench/torch_step.py, a 1-rank NCCL communicator. A step's time is
//     RunStep's wall time (it ends by reading the loss, so the GPU's work is
//     done). Output: {"seconds": [...], "losses": [...]} for the timed steps.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "executor/comm/communicator.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/cuda_status.h"
#include "executor/cuda/nccl_communicator.h"
#include "executor/data/batches.h"
#include "executor/runtime/program_runner.h"
#include "executor/runtime/timing_device.h"
#include "planner/graph/zoo.h"
#include "planner/lower/lower.h"

namespace {

using hap::executor::Device;
using hap::executor::TensorView;
using hap::graph::DType;

absl::Status Cublas(cublasStatus_t s, const char* expr) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(expr, ": cuBLAS status ", static_cast<int>(s)));
}
#define CUBLAS_OK(expr) HAP_RETURN_IF_ERROR(Cublas((expr), #expr))

struct Flags {
  std::string mode;
  std::string model = "gpt";
  std::string shapes = "1024x1024x1024,4096x4096x4096,8192x8192x8192,8192x4096x1024";
  int iters = 20;
  int steps = 20;
  int warmup = 3;
  int device = 0;
  int profile = 0;  // step: a per-kernel table of the timed steps on stderr
  bool bf16 = false;  // step --precision bf16: the bf16 mixed-precision program
  std::map<std::string, double> params;  // zoo parameters
};

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  if (argc < 2) return absl::InvalidArgumentError("usage: gpu_bench gemm|step [flags]");
  f.mode = argv[1];
  if (f.mode != "gemm" && f.mode != "step") {
    return absl::InvalidArgumentError(absl::StrCat("unknown mode '", f.mode, "' (gemm, step)"));
  }
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || i + 1 >= argc) {
      return absl::InvalidArgumentError(absl::StrCat("expected --NAME VALUE, got '", a, "'"));
    }
    std::string key = a.substr(2), v = argv[++i];
    int n = 0;
    if (key == "model") {
      f.model = v;
    } else if (key == "shapes") {
      f.shapes = v;
    } else if (key == "precision") {
      if (v != "fp32" && v != "bf16") {
        return absl::InvalidArgumentError(
            absl::StrCat("--precision must be fp32 or bf16, got '", v, "'"));
      }
      f.bf16 = v == "bf16";
    } else if (key == "iters" || key == "steps" || key == "warmup" || key == "device" ||
               key == "profile") {
      if (!absl::SimpleAtoi(v, &n) || n < 0) {
        return absl::InvalidArgumentError(absl::StrCat(a, " needs a count, got '", v, "'"));
      }
      (key == "iters"    ? f.iters
       : key == "steps"  ? f.steps
       : key == "warmup" ? f.warmup
       : key == "profile" ? f.profile
                         : f.device) = n;
    } else {
      double d = 0;
      if (!absl::SimpleAtod(v, &d)) {
        return absl::InvalidArgumentError(absl::StrCat(a, " needs a number, got '", v, "'"));
      }
      f.params[key] = d;
    }
  }
  if (f.iters < 1 || f.steps < 1) return absl::InvalidArgumentError("--iters/--steps must be >= 1");
  return f;
}

// Seconds per call of `fn` (which queues work on `stream`), by cudaEvents
// over `iters` calls after 3 warm-up calls.
absl::StatusOr<double> TimeOnStream(cudaStream_t stream, int iters,
                                    const std::function<absl::Status()>& fn) {
  for (int i = 0; i < 3; ++i) HAP_RETURN_IF_ERROR(fn());
  HAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "gpu_bench");
  cudaEvent_t start, stop;
  HAP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "gpu_bench");
  HAP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "gpu_bench");
  HAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream), "gpu_bench");
  for (int i = 0; i < iters; ++i) HAP_RETURN_IF_ERROR(fn());
  HAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream), "gpu_bench");
  HAP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop), "gpu_bench");
  float ms = 0;
  HAP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop), "gpu_bench");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 1e3 / iters;
}

void Report(const std::string& shape, const std::string& kind, double seconds, double flops) {
  std::printf("{\"shape\": \"%s\", \"kind\": \"%s\", \"seconds\": %.6g, \"tflops\": %.4g}\n",
              shape.c_str(), kind.c_str(), seconds, flops / seconds / 1e12);
  std::fflush(stdout);
}

absl::Status Gemm(const Flags& f) {
  hap::executor::CudaDeviceOptions exact, tf32;
  tf32.allow_tf32 = true;
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, hap::executor::NewCudaDevice(f.device, exact));
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev_tf32,
                       hap::executor::NewCudaDevice(f.device, tf32));
  HAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(f.device), "gpu_bench");
  cudaStream_t stream;
  HAP_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&stream), "gpu_bench");
  cublasHandle_t h;
  CUBLAS_OK(cublasCreate(&h));
  CUBLAS_OK(cublasSetStream(h, stream));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const std::vector<std::string> shapes = absl::StrSplit(f.shapes, ',', absl::SkipEmpty());
  for (const std::string& shape : shapes) {
    std::vector<std::string> mnk = absl::StrSplit(shape, 'x');
    int64_t m = 0, n = 0, k = 0;
    if (mnk.size() != 3 || !absl::SimpleAtoi(mnk[0], &m) || !absl::SimpleAtoi(mnk[1], &n) ||
        !absl::SimpleAtoi(mnk[2], &k) || m <= 0 || n <= 0 || k <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("shape '", shape, "' is not MxNxK"));
    }
    const double flops = 2.0 * m * n * k;
    // Buffers from our device (our kernel runs on its memory); cuBLAS uses
    // the same memory.
    std::vector<float> hx(m * k), hw(n * k);
    for (float& v : hx) v = u(rng);
    for (float& v : hw) v = u(rng);
    TensorView x{DType::kFloat32, {m, k}, nullptr}, w{DType::kFloat32, {n, k}, nullptr},
        y{DType::kFloat32, {m, n}, nullptr};
    HAP_ASSIGN_OR_RETURN(x.data, dev->Allocate(x.bytes()));
    HAP_ASSIGN_OR_RETURN(w.data, dev->Allocate(w.bytes()));
    HAP_ASSIGN_OR_RETURN(y.data, dev->Allocate(y.bytes()));
    HAP_RETURN_IF_ERROR(dev->CopyFromHost(hx.data(), x));
    HAP_RETURN_IF_ERROR(dev->CopyFromHost(hw.data(), w));
    HAP_RETURN_IF_ERROR(dev->Synchronize());
    hap::executor::KernelContext ctx;
    hap::graph::Attrs attrs;
    for (Device* d : {dev.get(), dev_tf32.get()}) {
      const TensorView in[] = {x, w};
      const TensorView out[] = {y};
      HAP_ASSIGN_OR_RETURN(
          double s, TimeOnStream(hap::executor::CudaComputeStream(*d), f.iters,
                                 [&] { return d->RunKernel("linear", ctx, attrs, in, out); }));
      Report(shape, d == dev.get() ? "ours_fp32" : "ours_tf32", s, flops);
    }
    {  // bf16 mixed precision: our linear with attribute bf16 (bf16 tensor
       // cores on fp32 operands, the result rounded to bf16)
      hap::graph::Attrs bf16_attrs;
      bf16_attrs.Set("bf16", true);
      const TensorView in[] = {x, w};
      const TensorView out[] = {y};
      HAP_ASSIGN_OR_RETURN(double s, TimeOnStream(hap::executor::CudaComputeStream(*dev),
                                                  f.iters, [&] {
                                                    return dev->RunKernel("linear", ctx,
                                                                          bf16_attrs, in, out);
                                                  }));
      Report(shape, "ours_bf16", s, flops);
    }
    HAP_RETURN_IF_ERROR(dev->Synchronize());
    HAP_RETURN_IF_ERROR(dev_tf32->Synchronize());
    const float one = 1.f, zero = 0.f;
    // Row-major y = x w^T is column-major y^T (N x M) = W (N x K) X^T.
    HAP_ASSIGN_OR_RETURN(
        double sgemm, TimeOnStream(stream, f.iters, [&] {
          return Cublas(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w.as<float>(), k,
                                    x.as<float>(), k, &zero, y.as<float>(), n),
                        "cublasSgemm");
        }));
    Report(shape, "cublas_sgemm_fp32", sgemm, flops);
    HAP_ASSIGN_OR_RETURN(
        double tf32s, TimeOnStream(stream, f.iters, [&] {
          return Cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w.data, CUDA_R_32F,
                                     k, x.data, CUDA_R_32F, k, &zero, y.data, CUDA_R_32F, n,
                                     CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
                        "cublasGemmEx tf32");
        }));
    Report(shape, "cublas_gemmex_tf32", tf32s, flops);
    // bf16 inputs, fp32 accumulation: the dense tensor-core peak. The bf16
    // copies are made once; their values do not matter for the time.
    void *xb = nullptr, *wb = nullptr;
    HAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&xb, m * k * 2), "gpu_bench");
    HAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&wb, n * k * 2), "gpu_bench");
    HAP_CUDA_RETURN_IF_ERROR(cudaMemset(xb, 0x3c, m * k * 2), "gpu_bench");
    HAP_CUDA_RETURN_IF_ERROR(cudaMemset(wb, 0x3c, n * k * 2), "gpu_bench");
    HAP_ASSIGN_OR_RETURN(double bf16s, TimeOnStream(stream, f.iters, [&] {
                           return Cublas(
                               cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, wb,
                                            CUDA_R_16BF, k, xb, CUDA_R_16BF, k, &zero, y.data,
                                            CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                               "cublasGemmEx bf16");
                         }));
    Report(shape, "cublas_gemmex_bf16", bf16s, flops);
    HAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "gpu_bench");
    cudaFree(xb);
    cudaFree(wb);
    dev->Free(x.data);
    dev->Free(w.data);
    dev->Free(y.data);
    HAP_RETURN_IF_ERROR(dev->Synchronize());
  }
  cublasDestroy(h);
  cudaStreamDestroy(stream);
  return absl::OkStatus();
}

absl::Status Step(const Flags& f) {
  HAP_ASSIGN_OR_RETURN(hap::graph::Graph g, hap::graph::BuildZooModel(f.model, f.params));
  hap::lower::LowerOptions lo;
  lo.world_size = 1;
  lo.seed = 1;
  lo.optimizer.set_kind(hap::v1::OptimizerConfig::SGD);
  lo.optimizer.set_learning_rate(0.01);
  lo.optimizer.set_momentum(0.9);
  lo.bf16 = f.bf16;
  HAP_ASSIGN_OR_RETURN(std::vector<hap::v1::RankProgram> programs,
                       hap::lower::Lower(g, hap::lower::SingleDeviceProgram(g), lo));
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, hap::executor::NewCudaDevice(f.device));
  char dir[] = "/tmp/hap-gpu-bench-XXXXXX";
  if (mkdtemp(dir) == nullptr) return absl::InternalError("mkdtemp failed");
  HAP_ASSIGN_OR_RETURN(std::unique_ptr<hap::executor::RendezvousStore> store,
                       hap::executor::NewFileStore(dir));
  hap::executor::NcclOptions no;
  no.device = device.get();
  auto comm = hap::executor::ConnectNccl(no, *store);
  std::filesystem::remove_all(dir);
  HAP_RETURN_IF_ERROR(comm.status());
  // --profile 1: each kernel synchronized and timed (slower steps; the
  // table says where a step's time goes, not how fast it is).
  std::unique_ptr<hap::executor::TimingDevice> timing;
  if (f.profile) timing = std::make_unique<hap::executor::TimingDevice>(device.get(), true);
  HAP_ASSIGN_OR_RETURN(
      std::unique_ptr<hap::executor::ProgramRunner> runner,
      hap::executor::ProgramRunner::Create(programs[0], g,
                                           timing ? timing.get() : device.get(), comm->get()));
  HAP_RETURN_IF_ERROR(runner->InitializeParameters());
  std::unique_ptr<hap::data::BatchSource> batches = hap::data::NewSyntheticBatches(g, 1);
  std::string seconds, losses;
  for (int i = 0; i < f.warmup + f.steps; ++i) {
    HAP_ASSIGN_OR_RETURN(hap::data::GlobalBatch batch, batches->Get(i));
    if (timing && i == f.warmup) timing->Reset();
    auto t0 = std::chrono::steady_clock::now();
    HAP_ASSIGN_OR_RETURN(double loss, runner->RunStep(batch, i));
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i < f.warmup) continue;
    absl::StrAppend(&seconds, seconds.empty() ? "" : ", ", absl::StrFormat("%.6g", s));
    absl::StrAppend(&losses, losses.empty() ? "" : ", ", absl::StrFormat("%.6g", loss));
  }
  std::printf("{\"seconds\": [%s], \"losses\": [%s]}\n", seconds.c_str(), losses.c_str());
  if (timing) std::fprintf(stderr, "%s", timing->Table(f.steps).c_str());
  runner.reset();
  comm->reset();
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Flags> f = ParseFlags(argc, argv);
  absl::Status s = f.status();
  if (s.ok()) s = f->mode == "gemm" ? Gemm(*f) : Step(*f);
  if (!s.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
