// The C interface of the standalone runtime's library (standalone.cpp), for ctypes (bitquilt.runtime.standalone.library)
// and for the native runner (native_runner.cpp). A file is opened once (bq_file_open) and serves every model
// (one per sequence length, bq_open) and the tokenizer (bq_tokenizer_open) opened on it, which keep it mapped.
// Functions that can fail return -1 (or null) and leave the reason in bq_error().
#pragma once

#include <cstdint>
#include <memory>

#include "runtime/standalone_file.h"

extern "C" {
const char* bq_error();
int bq_isa_supported(int isa);  // the int8 kernels' paths, bitquilt_q4::Isa: 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI
int bq_active_isa();
int bq_set_isa(int isa);
void bq_set_threads(int threads);
int bq_threads();
void* bq_file_open(const char* path);
void bq_file_free(void* file);
void* bq_open(void* file, int64_t max_len);
void bq_free(void* handle);
const float* bq_cache(void* handle, int64_t layer, int which);
const float* bq_rope(void* handle, int which);
int64_t bq_vocab(void* handle);
int bq_forward(void* handle, const int64_t* ids, int64_t T, int64_t pos, float* logits);
int bq_step(void* const* handles, int64_t n, const int64_t* ids, const int64_t* counts, const int64_t* pos,
            float* logits);
int bq_threshold(void* file, double avg_bits, float* tau);
void bq_set_threshold(void* handle, float tau);
double bq_routed_bits(void* handle);
void* bq_tokenizer_open(void* file);
void bq_tokenizer_free(void* tokenizer);
int64_t bq_tokenize(void* tokenizer, const char* text, int64_t n, int64_t* ids, int64_t capacity);
int64_t bq_detokenize(void* tokenizer, const int64_t* ids, int64_t n, int skip_special, char* out, int64_t capacity);
int64_t bq_argmax(const float* logits, int64_t n);
int64_t bq_sample(const float* logits, int64_t n, double temperature, double top_p, double uniform);
}

// bq_open for C++ callers holding the mapped file themselves (the native runner, whose tokenizer reads it too).
void* bq_open_mapped(const std::shared_ptr<const bitquilt_standalone::MappedFile>& file, int64_t max_len);

// bq_threshold for them: the threshold, or std::runtime_error with the reason.
float bq_threshold_mapped(const bitquilt_standalone::MappedFile& file, double avg_bits);
