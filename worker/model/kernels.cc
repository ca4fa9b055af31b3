// The reference model's CPU kernels (kernels.h). They follow the usual
// formulation of a GPT-2 style decoder (as in llm.c): every backward kernel
// adds into the parameter gradients, so the model's GradMode only decides
// whether they are zeroed first.
#include "worker/model/kernels.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

namespace tandem::model {
namespace kernels {
namespace {

constexpr float kLnEps = 1e-5f;
const float kGeluScale = static_cast<float>(std::sqrt(2.0 / std::numbers::pi));

}  // namespace

void AddBias(float* out, const float* b, int n, int oc) {
  for (int i = 0; i < n; ++i) {
    float* row = out + static_cast<size_t>(i) * oc;
    for (int o = 0; o < oc; ++o) row[o] += b[o];
  }
}

void LinearForward(float* out, const float* inp, const float* w, const float* b, int n, int ic, int oc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, oc, ic, 1.0f, inp, ic, w, ic, 0.0f, out, oc);
  if (b != nullptr) AddBias(out, b, n, oc);
}

void LinearBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w, int n,
                    int ic, int oc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, ic, oc, 1.0f, dout, oc, w, ic, 0.0f, dinp, ic);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, oc, ic, n, 1.0f, dout, oc, inp, ic, 1.0f, dw, ic);
  if (db == nullptr) return;
  for (int i = 0; i < n; ++i) {
    const float* row = dout + static_cast<size_t>(i) * oc;
    for (int o = 0; o < oc; ++o) db[o] += row[o];
  }
}

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int n,
                      int c) {
  for (int i = 0; i < n; ++i) {
    const float* x = inp + static_cast<size_t>(i) * c;
    float* y = out + static_cast<size_t>(i) * c;
    float m = 0;
    for (int j = 0; j < c; ++j) m += x[j];
    m /= static_cast<float>(c);
    float v = 0;
    for (int j = 0; j < c; ++j) v += (x[j] - m) * (x[j] - m);
    v /= static_cast<float>(c);
    const float s = 1.0f / std::sqrt(v + kLnEps);
    for (int j = 0; j < c; ++j) y[j] = (x[j] - m) * s * w[j] + b[j];
    mean[i] = m;
    rstd[i] = s;
  }
}

void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                       const float* mean, const float* rstd, int n, int c) {
  for (int i = 0; i < n; ++i) {
    const float* x = inp + static_cast<size_t>(i) * c;
    const float* dy = dout + static_cast<size_t>(i) * c;
    float* dx = dinp + static_cast<size_t>(i) * c;
    const float m = mean[i];
    const float s = rstd[i];
    float dnorm_mean = 0;
    float dnorm_norm_mean = 0;
    for (int j = 0; j < c; ++j) {
      const float norm = (x[j] - m) * s;
      const float dnorm = w[j] * dy[j];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<float>(c);
    dnorm_norm_mean /= static_cast<float>(c);
    for (int j = 0; j < c; ++j) {
      const float norm = (x[j] - m) * s;
      const float dnorm = w[j] * dy[j];
      db[j] += dy[j];
      dw[j] += norm * dy[j];
      dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

void GeluForward(float* out, const float* inp, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + 0.044715f * x * x * x)));
  }
}

void GeluBackward(float* dinout, const float* inp, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float t = std::tanh(kGeluScale * (x + 0.044715f * x * x * x));
    const float local = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinout[i] *= local;
  }
}

void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C, int H) {
  const int hs = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const float* q = qkv + static_cast<size_t>(b) * T * 3 * C + static_cast<size_t>(h) * hs;
      const float* k = q + C;
      const float* v = q + 2 * static_cast<ptrdiff_t>(C);
      float* a = att + (static_cast<size_t>(b) * H + h) * T * T;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, 3 * C, k, 3 * C, 0.0f, a, T);
      for (int i = 0; i < T; ++i) {
        float* row = a + static_cast<size_t>(i) * T;
        float mx = row[0];
        for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        float sum = 0;
        for (int j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        for (int j = i + 1; j < T; ++j) row[j] = 0.0f;
      }
      float* y = out + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hs;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, v, 3 * C, 0.0f, y, C);
    }
  }
}

void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att, int B, int T,
                       int C, int H) {
  const int hs = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const size_t base = static_cast<size_t>(b) * T * 3 * C + static_cast<size_t>(h) * hs;
      const float* q = qkv + base;
      const float* k = q + C;
      const float* v = q + 2 * static_cast<ptrdiff_t>(C);
      float* dq = dqkv + base;
      float* dk = dq + C;
      float* dv = dq + 2 * static_cast<ptrdiff_t>(C);
      const float* a = att + (static_cast<size_t>(b) * H + h) * T * T;
      const float* dy = dout + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hs;
      // datt = dy · vᵀ; dv = attᵀ · dy
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dy, C, v, 3 * C, 0.0f, scratch, T);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, dy, C, 0.0f, dv, 3 * C);
      // Softmax backward, in place: dpre = att ⊙ (datt - Σ att ⊙ datt). Masked entries have att = 0.
      for (int i = 0; i < T; ++i) {
        const float* arow = a + static_cast<size_t>(i) * T;
        float* drow = scratch + static_cast<size_t>(i) * T;
        float dot = 0;
        for (int j = 0; j <= i; ++j) dot += arow[j] * drow[j];
        for (int j = 0; j < T; ++j) drow[j] = arow[j] * (drow[j] - dot);
      }
      // dq = scale · dpre · k; dk = scale · dpreᵀ · q
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale, scratch, T, k, 3 * C, 0.0f, dq, 3 * C);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale, scratch, T, q, 3 * C, 0.0f, dk, 3 * C);
    }
  }
}

}  // namespace kernels

double RelativeDifference(std::span<const float> a, std::span<const float> b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return worst / (scale > 0 ? scale : 1.0);
}

void SetBlasThreads(int threads) {
#ifdef TANDEM_HAVE_OPENBLAS
  openblas_set_num_threads(std::max(threads, 1));
#else
  (void)threads;
#endif
}

}  // namespace tandem::model
