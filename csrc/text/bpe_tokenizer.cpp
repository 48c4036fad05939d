// The byte-level BPE tokenizer of bpe_tokenizer.h.

#include "text/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <climits>
#include <queue>
#include <stdexcept>

namespace bitquilt_tokenizer {

using bitquilt_json::Value;
using bitquilt_standalone::MappedFile;
using bitquilt_standalone::Tensor;

namespace {

bool space(uint32_t cp) {  // \s: Unicode White_Space (Oniguruma's \s on UTF-8)
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

bool newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// The length of the well-formed UTF-8 sequence at s[i] (its code point in `cp`), or 0 and the length of its
// maximal ill-formed subpart in `bad` (Unicode's "maximal subpart" rule).
int utf8_sequence(const std::string& s, size_t i, uint32_t& cp, int& bad) {
  const auto c = static_cast<uint8_t>(s[i]);
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  int need = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    bad = 1;
    return 0;
  }
  size_t j = i + 1;
  for (int k = 0; k < need; ++k, ++j) {
    const auto b = j < s.size() ? static_cast<uint8_t>(s[j]) : 0;
    if (j >= s.size() || b < (k == 0 ? lo : 0x80) || b > (k == 0 ? hi : 0xBF)) {
      bad = static_cast<int>(j - i);
      return 0;
    }
    cp = cp << 6 | (b & 0x3F);
  }
  return need + 1;
}

// Whether `s` is well-formed UTF-8 throughout.
bool valid_utf8(const std::string& s) {
  uint32_t cp = 0;
  int bad = 0;
  for (size_t i = 0; i < s.size();) {
    const int length = utf8_sequence(s, i, cp, bad);
    if (length == 0) return false;
    i += length;
  }
  return true;
}

// The first of `n` rows of `width` int32s, sorted by their first `keys` columns, whose key is not below `key`
// (`n` rows on: none).
const int32_t* lower_row(const int32_t* rows, int64_t n, int width, const int32_t* key, int keys) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (std::lexicographical_compare(rows + width * mid, rows + width * mid + keys, key, key + keys))
      lo = mid + 1;
    else
      hi = mid;
  }
  return rows + width * lo;
}

// The row of `n` whose first `keys` columns are `key`, or null.
const int32_t* find_row(const int32_t* rows, int64_t n, int width, const int32_t* key, int keys) {
  const int32_t* row = lower_row(rows, n, width, key, keys);
  return row < rows + width * n && std::equal(key, key + keys, row) ? row : nullptr;
}

// The code points of UTF-8 `text` and the byte offset of each (and of the end); std::runtime_error if not UTF-8.
void code_points(const std::string& text, std::vector<uint32_t>& cps, std::vector<int64_t>& at) {
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    int bad = 0;
    const int length = utf8_sequence(text, i, cp, bad);
    if (length == 0)
      throw std::runtime_error("the text is not UTF-8 (an ill-formed byte sequence at byte " + std::to_string(i) + ")");
    cps.push_back(cp);
    at.push_back(static_cast<int64_t>(i));
    i += length;
  }
  at.push_back(static_cast<int64_t>(text.size()));
}

// Hangul syllables: composed and decomposed arithmetically (Unicode's conjoining jamo rules)
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

// [file's "tokenizer" metadata] with the reason when the export has no tokenizer the native runner reads.
const Value& tokenizer_metadata(const MappedFile& f) {
  const Value& meta = f.config()["tokenizer"];
  if (meta.kind != Value::Object)
    throw std::runtime_error(f.path() + " has no tokenizer tables (exported by an older bitquilt); re-export it");
  if (meta.has("unsupported"))
    throw std::runtime_error(f.path() + ": its tokenizer is not one the native runner reads (" +
                             meta["unsupported"].string + "); " +
                             (meta.has("advice") ? meta["advice"].string : "run the export with bitquilt-run"));
  return meta;
}

std::vector<int64_t> ids_of(const Value& list) {
  std::vector<int64_t> ids;
  for (const auto& v : list.array) ids.push_back(v.integer());
  return ids;
}

}  // namespace

bool Tokenizer::Range::contains(uint32_t cp) const {
  int64_t lo = 0, hi = n;  // the first range whose end is >= cp
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<uint32_t>(rows[2 * mid + 1]) < cp)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && static_cast<uint32_t>(rows[2 * lo]) <= cp;
}

int32_t Tokenizer::Nfc::combining_class(uint32_t cp) const {
  const int32_t key = static_cast<int32_t>(cp);
  const int32_t* row = find_row(classes, n_classes, 2, &key, 1);
  return row ? row[1] : 0;
}

int64_t Tokenizer::Nfc::compose(uint32_t first, uint32_t second) const {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase && second < kVBase + kVCount)
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 && second > kTBase &&
      second < kTBase + kTCount)
    return first + (second - kTBase);
  const int32_t key[2] = {static_cast<int32_t>(first), static_cast<int32_t>(second)};
  const int32_t* row = find_row(compositions, n_compositions, 3, key, 2);
  return row ? row[2] : -1;
}

std::vector<uint32_t> Tokenizer::Nfc::apply(const std::vector<uint32_t>& cps) const {
  std::vector<uint32_t> d;  // 1. the full canonical decomposition
  for (const uint32_t cp : cps) {
    const int32_t key = static_cast<int32_t>(cp);
    if (cp >= kSBase && cp < kSBase + kSCount) {
      const uint32_t s = cp - kSBase;
      d.push_back(kLBase + s / kNCount);
      d.push_back(kVBase + s % kNCount / kTCount);
      if (s % kTCount) d.push_back(kTBase + s % kTCount);
    } else if (const int32_t* row = find_row(decompositions, n_decompositions, 5, &key, 1)) {
      for (int j = 1; j < 5 && row[j] >= 0; ++j) d.push_back(static_cast<uint32_t>(row[j]));
    } else {
      d.push_back(cp);
    }
  }
  for (size_t i = 1; i < d.size(); ++i) {  // 2. canonical order: each run of non-starters sorted by class, stably
    const int32_t c = combining_class(d[i]);
    for (size_t j = i; c != 0 && j > 0 && combining_class(d[j - 1]) > c; --j) std::swap(d[j - 1], d[j]);
  }
  if (d.empty()) return d;
  // 3. canonical composition: a character joins the last starter unless a character between them is blocking
  // (of its class or higher, or a starter)
  size_t starter = 0, out = 1;
  int32_t last = combining_class(d[0]) ? 256 : 0;
  for (size_t i = 1; i < d.size(); ++i) {
    const int32_t c = combining_class(d[i]);
    const int64_t composite = compose(d[starter], d[i]);
    if (composite >= 0 && (last < c || last == 0)) {
      d[starter] = static_cast<uint32_t>(composite);
      continue;
    }
    if (c == 0) starter = out;
    last = c;
    d[out++] = d[i];
  }
  d.resize(out);
  return d;
}

Tokenizer::Tokenizer(std::shared_ptr<const MappedFile> file) : file_(std::move(file)) {
  const MappedFile& f = *file_;
  const Value& meta = tokenizer_metadata(f);
  const Tensor bytes = f.tensor("tokenizer.token_bytes", "U8"), ends = f.tensor("tokenizer.token_ends", "I64");
  const Tensor byte_ids = f.tensor("tokenizer.byte_ids", "I32"), merges = f.tensor("tokenizer.merges", "I32");
  const Tensor added = f.tensor("tokenizer.added", "I32");
  const Tensor letters = f.tensor("tokenizer.letters", "I32"), numbers = f.tensor("tokenizer.numbers", "I32");
  tokens_ = ends.numel() - 1;
  token_bytes_ = bytes.as<uint8_t>();
  token_ends_ = ends.as<int64_t>();
  bool fits = tokens_ > 0 && token_ends_[0] == 0 && token_ends_[tokens_] == bytes.numel() && byte_ids.numel() == 256;
  for (int64_t i = 0; fits && i < tokens_; ++i) fits = token_ends_[i] <= token_ends_[i + 1];
  const auto pairs = [](const Tensor& t, int64_t width) { return t.shape.size() == 2 && t.shape[1] == width; };
  if (!fits || !pairs(merges, 4) || !pairs(added, 2) || !pairs(letters, 2) || !pairs(numbers, 2))
    throw std::runtime_error(f.path() + ": its tokenizer tables do not fit together; re-export it");
  byte_ids_ = byte_ids.as<int32_t>();
  merges_ = merges.as<int32_t>();
  merges_n_ = merges.shape[0];
  added_ = added.as<int32_t>();
  added_n_ = added.shape[0];
  for (int64_t a = 0; a < added_n_; ++a) {
    const int64_t id = added_[2 * a];
    if (id < 0 || id >= tokens_) throw std::runtime_error(f.path() + ": added token id outside the tokenizer");
    added_text_.emplace_back(reinterpret_cast<const char*>(token_bytes_ + token_ends_[id]),
                             token_ends_[id + 1] - token_ends_[id]);
  }
  letters_ = {letters.as<int32_t>(), letters.shape[0]};
  numbers_ = {numbers.as<int32_t>(), numbers.shape[0]};
  if (meta["normalizer"].string == "nfc") {
    const Tensor decompositions = f.tensor("tokenizer.nfc_decompositions", "I32");
    const Tensor classes = f.tensor("tokenizer.nfc_classes", "I32");
    const Tensor compositions = f.tensor("tokenizer.nfc_compositions", "I32");
    if (!pairs(decompositions, 5) || !pairs(classes, 2) || !pairs(compositions, 3))
      throw std::runtime_error(f.path() + ": its NFC tables are not [n, 5], [n, 2], [n, 3]; re-export it");
    nfc_ = {decompositions.as<int32_t>(), decompositions.shape[0], classes.as<int32_t>(),  classes.shape[0],
            compositions.as<int32_t>(),   compositions.shape[0]};
  } else if (meta["normalizer"].kind != Value::Null) {
    throw std::runtime_error(f.path() + ": normalizer '" + meta["normalizer"].string + "' is not one this bitquilt knows");
  }
  const std::string& split = meta["pre_tokenizer"].string;
  if (split == "gpt2")
    split_ = Split::Gpt2;
  else if (split == "gpt2-digits")
    split_ = Split::Gpt2Digits;
  else if (split == "qwen2")
    split_ = Split::Qwen2;
  else if (split == "sentencepiece")
    split_ = Split::Sentencepiece;
  else
    throw std::runtime_error(f.path() + ": pre-tokenizer '" + split + "' is not one this bitquilt knows");
  if (split_ == Split::Sentencepiece) {
    const Tensor chars = f.tensor("tokenizer.chars", "I32");
    if (!pairs(chars, 2)) throw std::runtime_error(f.path() + ": its character table is not [n, 2]; re-export it");
    chars_ = chars.as<int32_t>();
    chars_n_ = chars.shape[0];
  }
  prefix_ = ids_of(meta["prefix"]);
  suffix_ = ids_of(meta["suffix"]);
  eos_ = meta["eos"].kind == Value::Number ? meta["eos"].integer() : -1;
}

// GPT-2's 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ at cps[i] (leftmost
// alternative that matches, as a backtracking regex takes it): the end of the piece.
int64_t Tokenizer::gpt2_piece(const std::vector<uint32_t>& cps, int64_t i, int64_t end) const {
  const auto at = [&](int64_t k) { return k < end ? cps[k] : 0xFFFFFFFFu; };
  if (at(i) == '\'') {
    const uint32_t a = at(i + 1), b = at(i + 2);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  const auto other = [&](uint32_t cp) { return !space(cp) && !letter(cp) && !number(cp); };
  for (int kind = 0; kind < 3; ++kind) {
    const auto in = [&](int64_t k) {
      if (k >= end) return false;
      return kind == 0 ? letter(cps[k]) : kind == 1 ? number(cps[k]) : other(cps[k]);
    };
    const int64_t start = at(i) == ' ' && in(i + 1) ? i + 1 : i;
    if (in(start)) {
      int64_t k = start;
      while (in(k)) ++k;
      return k;
    }
  }
  int64_t k = i;  // whitespace: \s+(?!\S) leaves the last space to the next piece, \s+ when that empties it
  while (k < end && space(cps[k])) ++k;
  return k < end && k - i >= 2 ? k - 1 : k;
}

// Qwen2's (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|
// \s+(?!\S)|\s+ at cps[i]: the end of the piece.
int64_t Tokenizer::qwen2_piece(const std::vector<uint32_t>& cps, int64_t i, int64_t end) const {
  const auto at = [&](int64_t k) { return k < end ? cps[k] : 0xFFFFFFFFu; };
  const auto lower = [](uint32_t cp) { return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp; };
  if (at(i) == '\'') {
    const uint32_t a = lower(at(i + 1)), b = lower(at(i + 2));
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  const auto letters_from = [&](int64_t k) {
    while (k < end && letter(cps[k])) ++k;
    return k;
  };
  if (letter(at(i))) return letters_from(i);
  if (i < end && !newline(cps[i]) && !number(cps[i]) && i + 1 < end && letter(cps[i + 1])) return letters_from(i + 1);
  if (i < end && number(cps[i])) return i + 1;
  const auto other = [&](int64_t k) { return k < end && !space(cps[k]) && !letter(cps[k]) && !number(cps[k]); };
  const int64_t start = at(i) == ' ' && other(i + 1) ? i + 1 : i;
  if (other(start)) {
    int64_t k = start;
    while (other(k)) ++k;
    while (k < end && newline(cps[k])) ++k;
    return k;
  }
  int64_t k = i;  // whitespace
  while (k < end && space(cps[k])) ++k;
  for (int64_t last = k - 1; last >= i; --last)  // \s*[\r\n]+: through the run's last line break
    if (newline(cps[last])) return last + 1;
  return k < end && k - i >= 2 ? k - 1 : k;
}

void Tokenizer::pre_tokenized(const std::string& text, const std::vector<uint32_t>& cps,
                              const std::vector<int64_t>& at, std::vector<int64_t>& ids) const {
  const int64_t end = static_cast<int64_t>(cps.size());
  const auto pieces = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to;) {
      const int64_t next = split_ == Split::Qwen2 ? qwen2_piece(cps, i, to) : gpt2_piece(cps, i, to);
      bpe(reinterpret_cast<const uint8_t*>(text.data()) + at[i], at[next] - at[i], ids);
      i = next;
    }
  };
  if (split_ != Split::Gpt2Digits) return pieces(0, end);
  int64_t from = 0;  // every digit a piece of its own, GPT-2's split between them
  for (int64_t i = 0; i < end; ++i)
    if (number(cps[i])) {
      pieces(from, i);
      pieces(i, i + 1);
      from = i + 1;
    }
  pieces(from, end);
}

void Tokenizer::bpe(const uint8_t* bytes, int64_t n, std::vector<int64_t>& ids) const {
  std::vector<int32_t> start;
  for (int64_t i = 0; i < n; ++i)
    if (byte_ids_[bytes[i]] >= 0) start.push_back(byte_ids_[bytes[i]]);
  merge(std::move(start), ids);
}

void Tokenizer::sentencepiece(const std::vector<uint32_t>& cps, std::vector<int64_t>& ids) const {
  std::vector<int32_t> start;
  std::string bytes;
  for (uint32_t cp : cps) {
    if (cp == ' ') cp = 0x2581;  // the normalizer: a space is "▁"
    const int32_t key = static_cast<int32_t>(cp);
    if (const int32_t* row = find_row(chars_, chars_n_, 2, &key, 1)) {
      start.push_back(row[1]);
      continue;
    }
    bytes.clear();
    bitquilt_json::append_utf8(bytes, cp);
    for (const char c : bytes)  // byte fallback (a byte without a token is dropped, as BPE drops it)
      if (byte_ids_[static_cast<uint8_t>(c)] >= 0) start.push_back(byte_ids_[static_cast<uint8_t>(c)]);
  }
  merge(std::move(start), ids);
}

void Tokenizer::merge(std::vector<int32_t> start, std::vector<int64_t>& ids) const {
  struct Symbol {
    int32_t id, prev, next;  // a doubly linked list over the piece's symbols; id -1 once merged into its left
  };
  std::vector<Symbol> symbols;
  for (const int32_t id : start) {
    const auto k = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, k - 1, k + 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;
  // candidate merges (rank, left symbol, left id, right id, merged id), lowest rank first, then leftmost; an entry
  // whose pair has changed since it was queued is skipped when it comes up
  using Candidate = std::array<int32_t, 5>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  const auto queue_pair = [&](int32_t left) {
    if (left < 0 || symbols[left].next < 0) return;
    const int32_t key[2] = {symbols[left].id, symbols[symbols[left].next].id};
    if (const int32_t* m = find_row(merges_, merges_n_, 4, key, 2)) queue.push({m[2], left, key[0], key[1], m[3]});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) queue_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int32_t left = top[1];
    Symbol& a = symbols[left];
    if (a.id != top[2] || a.next < 0 || symbols[a.next].id != top[3]) continue;
    a.id = top[4];
    Symbol& b = symbols[a.next];
    b.id = -1;
    a.next = b.next;
    if (a.next >= 0) symbols[a.next].prev = left;
    queue_pair(a.prev);
    queue_pair(left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

void Tokenizer::plain(const std::string& text, std::vector<int64_t>& ids) const {
  std::vector<uint32_t> cps;
  std::vector<int64_t> at;
  code_points(text, cps, at);
  if (split_ == Split::Sentencepiece) return sentencepiece(cps, ids);
  if (!nfc_.enabled()) return pre_tokenized(text, cps, at, ids);
  std::string normalized;
  for (const uint32_t cp : nfc_.apply(cps)) bitquilt_json::append_utf8(normalized, cp);
  cps.clear();
  at.clear();
  code_points(normalized, cps, at);
  pre_tokenized(normalized, cps, at, ids);
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  std::vector<uint32_t> cps;
  std::vector<int64_t> at;  // the byte offset of each code point, and the end
  code_points(text, cps, at);
  std::vector<int64_t> ids(prefix_);
  int64_t from = 0;  // the byte after the last added token
  for (int64_t i = 0; i < static_cast<int64_t>(cps.size()); ++i) {
    int64_t found = -1;
    size_t longest = 0;
    for (int64_t a = 0; a < added_n_; ++a) {
      const std::string& t = added_text_[a];
      if (t.size() > longest && text.compare(at[i], t.size(), t) == 0) {
        found = a;
        longest = t.size();
      }
    }
    if (found < 0) continue;
    plain(text.substr(from, at[i] - from), ids);
    ids.push_back(added_[2 * found]);
    from = at[i] + static_cast<int64_t>(longest);
    while (at[i + 1] < from) ++i;  // on to the token's last code point
  }
  plain(text.substr(from), ids);
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  return ids;
}

bool Tokenizer::special(int64_t id) const {
  const int32_t* end = added_ + 2 * added_n_;
  for (const int32_t* a = added_; a < end; a += 2)
    if (a[0] == id) return a[1] != 0;
  return false;
}

std::string Tokenizer::decode(const int64_t* ids, int64_t n, bool skip_special) const {
  std::string out, run;
  int64_t run_tokens = 0;
  // SentencePiece's byte fallback: a run of `<0xNN>` tokens is its bytes where they are UTF-8, else U+FFFD per token
  const auto end_run = [&] {
    if (valid_utf8(run))
      out += run;
    else
      for (int64_t k = 0; k < run_tokens; ++k) out += "\xEF\xBF\xBD";
    run.clear();
    run_tokens = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= tokens_ || (skip_special && special(id))) continue;
    std::string& to = split_ == Split::Sentencepiece && byte_token(id) ? run : out;
    if (&to == &out && run_tokens > 0) end_run();
    run_tokens += &to == &run;
    to.append(reinterpret_cast<const char*>(token_bytes_ + token_ends_[id]), token_ends_[id + 1] - token_ends_[id]);
  }
  if (run_tokens > 0) end_run();
  return out;
}

bool Tokenizer::byte_token(int64_t id) const { return std::find(byte_ids_, byte_ids_ + 256, id) != byte_ids_ + 256; }

std::string utf8_lossy(const std::string& bytes) {
  std::string out;
  for (size_t i = 0; i < bytes.size();) {
    uint32_t cp = 0;
    int bad = 0;
    const int length = utf8_sequence(bytes, i, cp, bad);
    if (length > 0) {
      out.append(bytes, i, length);
      i += length;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

}  // namespace bitquilt_tokenizer
