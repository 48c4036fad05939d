// bitquilt-native: generate text with a standalone export from a program without Python. The same model code as
// bitquilt-run (standalone.cpp's loader, kernels and sampling) with the export's own tokenizer tables
// (bpe_tokenizer.h), the same options and output: the prompt and its continuation as it is generated on stdout,
// then what ran (runtime, engine with its kernel path) and the figures on stderr (or everything as JSON with
// --json). Sampled draws use Python's generator (MT19937 seeded as random.Random(seed) seeds it), so a seed gives
// bitquilt-run's tokens. Errors are one line and exit 2.
//
//   bitquilt-native OUT_DIR --prompt "The capital of France is" --max-new-tokens 32 --threads 2

#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <vector>

#include "runtime/standalone.h"
#include "text/bpe_tokenizer.h"


namespace {

constexpr const char* kFile = "standalone.safetensors";
constexpr const char* kUsage =
    "usage: bitquilt-native MODEL --prompt TEXT [--max-new-tokens N] [--temperature T] [--seed S] [--ignore-eos]\n"
    "                       [--avg-bits B] [--threads N] [--isa {avx2,avxvnni,avx512}] [--json]\n"
    "\n"
    "Generate text with a standalone export (`bitquilt export SAVED -o OUT --to standalone`), without Python.\n"
    "\n"
    "  MODEL               directory written by `bitquilt export --to standalone`\n"
    "  --prompt TEXT       text to continue\n"
    "  --max-new-tokens N  tokens to generate (default 64)\n"
    "  --temperature T     0 (default): greedy; above: sampled\n"
    "  --seed S            sampling seed (default 0; the draws of bitquilt-run's)\n"
    "  --ignore-eos        do not stop at the end-of-sequence token\n"
    "  --avg-bits B        a MoBiQuant export: route tokens to B bits per weight on average\n"
    "                      (default: the checkpoint's saved thresholds)\n"
    "  --threads N         threads (default: every core)\n"
    "  --isa ISA           kernel path (default: $BITQUILT_ISA, else the widest)\n"
    "  --json              print the completion and figures as JSON\n";

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// stdout could not be written (a full disk): exit 1, as bitquilt-run (bitquilt.errors.run_command).
struct WriteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The ranges bitquilt-run takes (bitquilt/flag_checks.py): a larger count would wrap in an int or overflow a length.
constexpr int64_t kMaxNewTokens = 2147483647, kMaxThreads = 1024, kMaxSeed = INT64_MAX;

// The int8 kernels' paths by name, in bitquilt_q4::Isa's order (bitquilt.isa.INT8_ISAS).
constexpr const char* kIsaNames[] = {"avx2", "avxvnni", "avx512"};

constexpr int kIsas = static_cast<int>(std::size(kIsaNames));

int isa_index(const std::string& name) {
  for (int i = 0; i < kIsas; ++i)
    if (name == kIsaNames[i]) return i;
  return -1;
}

struct Options {
  std::string model, prompt, isa;
  bool has_prompt = false, ignore_eos = false, json = false;
  int64_t max_new_tokens = 64, seed = 0;
  double temperature = 0;
  std::optional<double> avg_bits;
  int threads = omp_get_num_procs();
};

// `text` as a finite number for option `name`.
double float_option(const std::string& name, const char* text) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (*text == '\0' || *end != '\0' || !std::isfinite(v))
    throw UserError("argument " + name + ": invalid float value: '" + text + "'");
  return v;
}

// `text` as an integer in [low, high] for option `name`.
int64_t integer_option(const std::string& name, const char* text, int64_t low, int64_t high) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || (errno != 0 && errno != ERANGE))
    throw UserError("argument " + name + ": invalid int value: '" + text + "'");
  if (errno == ERANGE ? text[0] == '-' : v < low)
    throw UserError(name + " must be ≥ " + std::to_string(low) + ", got " + text);
  if (errno == ERANGE || v > high) throw UserError(name + " must be ≤ " + std::to_string(high) + ", got " + text);
  return v;
}

// Flushes stdout; a failed write (a full disk) is a WriteError. A closed pipe (`| head`) ends the process by
// SIGPIPE, as it does cat: main restores its default, which Python's exec into this program leaves ignored.
void flush_out() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout))
    throw WriteError(std::string("cannot write the output: ") + std::strerror(errno));
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) throw UserError("argument " + arg + ": expected one argument");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--prompt") {
      o.prompt = value();
      o.has_prompt = true;
    } else if (arg == "--max-new-tokens") {
      o.max_new_tokens = integer_option(arg, value(), 1, kMaxNewTokens);
    } else if (arg == "--temperature") {
      const char* text = value();
      o.temperature = float_option(arg, text);
      if (o.temperature < 0) throw UserError("--temperature must be ≥ 0, got " + std::string(text));
    } else if (arg == "--avg-bits") {
      o.avg_bits = float_option(arg, value());
    } else if (arg == "--seed") {
      o.seed = integer_option(arg, value(), 0, kMaxSeed);
    } else if (arg == "--threads") {
      o.threads = static_cast<int>(integer_option(arg, value(), 1, kMaxThreads));
    } else if (arg == "--isa") {
      o.isa = value();
      if (isa_index(o.isa) < 0)
        throw UserError("argument --isa: invalid choice: '" + o.isa + "' (choose from 'avx2', 'avxvnni', 'avx512')");
    } else if (arg == "--ignore-eos") {
      o.ignore_eos = true;
    } else if (arg == "--json") {
      o.json = true;
    } else if (!arg.empty() && arg[0] == '-') {
      throw UserError("unrecognized argument: " + arg);
    } else if (o.model.empty()) {
      o.model = arg;
    } else {
      throw UserError("unrecognized argument: " + arg);
    }
  }
  if (o.model.empty() || !o.has_prompt) throw UserError("the following arguments are required: MODEL, --prompt");
  if (o.prompt.empty()) throw UserError("--prompt is empty; give the text to continue");
  return o;
}

// The kernel path: --isa, else $BITQUILT_ISA where supported, else the widest (bitquilt.isa.choose's rule).
void choose_isa(const std::string& requested) {
  std::string supported;
  int widest = 0;
  for (int i = 0; i < kIsas; ++i)
    if (bq_isa_supported(i)) {
      supported += (supported.empty() ? "" : ", ") + std::string(kIsaNames[i]);
      widest = i;
    }
  int isa = isa_index(requested);
  if (requested.empty()) {
    std::string wanted;
    if (const char* env = std::getenv("BITQUILT_ISA"))
      for (const char* c = env; *c; ++c)
        if (!std::isspace(static_cast<unsigned char>(*c))) wanted += static_cast<char>(std::tolower(*c));
    isa = isa_index(wanted);
    if (isa < 0 || !bq_isa_supported(isa)) {
      if (!wanted.empty())
        std::fprintf(stderr, "bitquilt: BITQUILT_ISA=%s is not a supported standalone kernel path (%s); using %s\n",
                     wanted.c_str(), supported.c_str(), kIsaNames[widest]);
      isa = widest;
    }
  } else if (!bq_isa_supported(isa)) {
    throw UserError("standalone kernel path '" + requested + "' unavailable here; supported: " + supported);
  }
  bq_set_isa(isa);
}

// Python's random.Random(seed).random(): MT19937 seeded by init_by_array with |seed|'s 32-bit words.
class PythonRandom {
 public:
  explicit PythonRandom(int64_t seed) {
    uint64_t s = seed < 0 ? 0 - static_cast<uint64_t>(seed) : static_cast<uint64_t>(seed);
    std::vector<uint32_t> key;
    do {
      key.push_back(static_cast<uint32_t>(s));
      s >>= 32;
    } while (s);
    mt_[0] = 19650218u;
    for (uint32_t i = 1; i < kN; ++i) mt_[i] = 1812433253u * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + i;
    uint32_t i = 1, j = 0;
    for (size_t k = std::max<size_t>(kN, key.size()); k; --k) {
      mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525u)) + key[j] + j;
      if (++i >= kN) mt_[0] = mt_[kN - 1], i = 1;
      if (++j >= key.size()) j = 0;
    }
    for (uint32_t k = kN - 1; k; --k) {
      mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941u)) - i;
      if (++i >= kN) mt_[0] = mt_[kN - 1], i = 1;
    }
    mt_[0] = 0x80000000u;
  }

  double random() {  // 53 random bits in [0, 1)
    const uint32_t a = next() >> 5, b = next() >> 6;
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
  }

 private:
  static constexpr uint32_t kN = 624, kM = 397;
  uint32_t next() {
    if (index_ >= kN) {
      for (uint32_t k = 0; k < kN; ++k) {
        const uint32_t y = (mt_[k] & 0x80000000u) | (mt_[(k + 1) % kN] & 0x7fffffffu);
        mt_[k] = mt_[(k + kM) % kN] ^ (y >> 1) ^ (y & 1 ? 0x9908b0dfu : 0u);
      }
      index_ = 0;
    }
    uint32_t y = mt_[index_++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
  }
  uint32_t mt_[kN];
  uint32_t index_ = kN;
};

double peak_rss_mb() {  // VmHWM, MiB (as bitquilt.resources.peak_rss_mb)
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024;
  return 0;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", c);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The completion printed as tokens come, as bitquilt.runtime.standalone.generate does: the text of the new ids so far,
// shown when it grew and does not end inside a character (U+FFFD), the prompt before the first piece.
class Stream {
 public:
  Stream(const bitquilt_tokenizer::Tokenizer& tokenizer, const std::string& prompt, bool quiet)
      : tokenizer_(tokenizer), prompt_(prompt), quiet_(quiet) {}

  void add(int64_t id) {
    ids_.push_back(id);
    if (quiet_) return;
    const std::string text = this->text();
    if (text.size() < 3 || text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") != 0) show(text);
  }
  void finish() {
    if (!quiet_) show(text());
  }
  std::string text() const {
    return bitquilt_tokenizer::utf8_lossy(tokenizer_.decode(ids_.data(), static_cast<int64_t>(ids_.size()), true));
  }
  const std::vector<int64_t>& ids() const { return ids_; }
  bool shown() const { return started_; }

 private:
  void show(const std::string& text) {
    if (text.size() <= shown_.size() || text.compare(0, shown_.size(), shown_) != 0) return;
    const std::string piece = (started_ ? "" : prompt_) + text.substr(shown_.size());
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    flush_out();
    shown_ = text;
    started_ = true;
  }

  const bitquilt_tokenizer::Tokenizer& tokenizer_;
  const std::string& prompt_;
  bool quiet_;
  std::vector<int64_t> ids_;
  std::string shown_;
  bool started_ = false;
};

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct ModelHandle {  // bq_open's model, freed at scope exit
  explicit ModelHandle(void* h) : handle(h) {}
  ~ModelHandle() { bq_free(handle); }
  void* handle;
};

int run(int argc, char** argv) {
  const auto start = Clock::now();
  const Options o = parse(argc, argv);
  omp_set_num_threads(o.threads);
  choose_isa(o.isa);
  const std::string path = o.model + "/" + kFile;
  struct stat st {};
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw UserError(o.model + " is not a standalone export (no " + kFile +
                    "); write one with `bitquilt export SAVED_DIR -o OUT --to standalone`");
  const auto file = std::make_shared<const bitquilt_standalone::MappedFile>(path);  // one mapping for both
  // (--avg-bits checked first: a model without routers says so, whatever its tokenizer)
  const float threshold = o.avg_bits ? bq_threshold_mapped(*file, *o.avg_bits) : NAN;  // NaN: the saved ones
  const bitquilt_tokenizer::Tokenizer tokenizer(file);
  const std::vector<int64_t> prompt = tokenizer.encode(o.prompt);
  if (prompt.empty()) throw UserError("the prompt has no tokens; give the text to continue");
  const ModelHandle model(bq_open_mapped(file, static_cast<int64_t>(prompt.size()) + o.max_new_tokens));
  if (model.handle == nullptr) throw UserError(bq_error());
  bq_set_threshold(model.handle, threshold);
  const double loaded = seconds(start, Clock::now());

  std::vector<float> logits(bq_vocab(model.handle));
  PythonRandom draws(o.seed);
  int64_t pos = 0;
  const auto step = [&](const int64_t* ids, int64_t n) {
    if (bq_forward(model.handle, ids, n, pos, logits.data()) < 0) throw UserError(o.model + ": " + bq_error());
    pos += n;
    const auto vocab = static_cast<int64_t>(logits.size());
    const int64_t token = o.temperature <= 0 ? bq_argmax(logits.data(), vocab)
                                             : bq_sample(logits.data(), vocab, o.temperature, 1.0, draws.random());
    if (token < 0) throw UserError(bitquilt_standalone::kNonFinite);
    return token;
  };
  Stream stream(tokenizer, o.prompt, o.json);
  const auto t0 = Clock::now();
  int64_t token = step(prompt.data(), static_cast<int64_t>(prompt.size()));
  const auto t1 = Clock::now();
  stream.add(token);
  const bool stops = !o.ignore_eos && tokenizer.eos() >= 0;
  while (static_cast<int64_t>(stream.ids().size()) < o.max_new_tokens && !(stops && token == tokenizer.eos())) {
    token = step(&token, 1);
    stream.add(token);
  }
  const auto t2 = Clock::now();
  stream.finish();

  const int64_t n = static_cast<int64_t>(stream.ids().size());
  const double prefill = static_cast<double>(prompt.size()) / seconds(t0, t1);
  const std::optional<double> decode =
      n > 1 ? std::optional<double>((n - 1) / seconds(t1, t2)) : std::nullopt;
  const double peak = peak_rss_mb(), bits = bq_routed_bits(model.handle);  // NaN: no routed linears
  char bits_text[32] = "null";
  if (!std::isnan(bits)) std::snprintf(bits_text, sizeof bits_text, "%.17g", bits);
  // what ran, as bitquilt-run's "standalone (ISA kernels)" and generate's runtime name it: this program, its path
  const std::string engine = std::string("bitquilt-native (") + kIsaNames[bq_active_isa()] + " kernels)";
  if (o.json) {
    char decode_text[32] = "null";
    if (decode) std::snprintf(decode_text, sizeof decode_text, "%.17g", *decode);
    std::printf("{\n  \"prompt\": %s,\n  \"completion\": %s,\n  \"runtime\": \"standalone\",\n  \"engine\": %s,\n"
                "  \"prompt_tokens\": %zu,\n  \"new_tokens\": %lld,\n  \"prefill_tokens_per_s\": %.17g,\n"
                "  \"decode_tokens_per_s\": %s,\n  \"avg_bits\": %s,\n  \"load_seconds\": %.17g,\n"
                "  \"peak_rss_mb\": %.17g\n}\n",
                json_string(o.prompt).c_str(), json_string(stream.text()).c_str(), json_string(engine).c_str(),
                prompt.size(), static_cast<long long>(n), prefill, decode_text, bits_text, loaded, peak);
    flush_out();
  } else {
    std::printf("%s\n", stream.shown() ? "" : o.prompt.c_str());
    flush_out();
    std::fprintf(stderr, "runtime=standalone, engine=%s, prompt_tokens=%zu, new_tokens=%lld, ", engine.c_str(),
                 prompt.size(), static_cast<long long>(n));
    std::fprintf(stderr, "prefill_tokens_per_s=%.4g, ", prefill);
    if (decode) std::fprintf(stderr, "decode_tokens_per_s=%.4g, ", *decode);
    if (!std::isnan(bits)) std::fprintf(stderr, "avg_bits=%.4g, ", bits);
    std::fprintf(stderr, "load_seconds=%.4g, peak_rss_mb=%.4g\n", loaded, peak);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_DFL);
  try {
    return run(argc, argv);
  } catch (const WriteError& e) {
    std::fprintf(stderr, "bitquilt-native: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "bitquilt-native: error: %s\n", e.what());
    return 2;
  }
}
