// A byte-level BPE tokenizer read from the tables of a standalone file (bitquilt.export.tokenizer_tables), giving
// the ids and text Hugging Face's `tokenizers` gives for the pre-tokenizers it knows (GPT-2's split, with digits
// alone first or not, and Qwen2's), so that the native runner needs neither Python nor tokenizer.json.
//
// Encoding, as `tokenizers` does it: the added tokens are split out of the text (leftmost, then longest match);
// every other stretch is normalized (NFC, where the tokenizer does) and cut into pieces by the pre-tokenizer's pattern, written out here as a scanner over code
// points (\p{L} and \p{N} from the file's tables, \s the Unicode White_Space set); each piece's bytes start as
// their byte tokens and the adjacent pair of lowest merge rank (the leftmost of equals) is merged until none is
// left; the post-processor's ids go around. Decoding concatenates the tokens' bytes.
//
// A SentencePiece-style tokenizer (Gemma's) instead normalizes spaces to U+2581 and takes each stretch between added
// tokens as one piece, whose characters start as their one-character tokens (the file's `chars`), or as the
// `<0xNN>` tokens of their UTF-8 bytes where they have none (byte fallback); the merges then run as above, and
// the tokens' bytes are their decoded text ("▁" a space, `<0xNN>` the byte).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/standalone_file.h"

namespace bitquilt_tokenizer {

class Tokenizer {
 public:
  // The tokenizer of a standalone file; std::runtime_error when it has none the native tokenizer reads.
  explicit Tokenizer(std::shared_ptr<const bitquilt_standalone::MappedFile> file);

  // The ids of UTF-8 `text` (std::runtime_error when it is not UTF-8).
  std::vector<int64_t> encode(const std::string& text) const;
  // The bytes of tokens `ids` (ids the tokenizer lacks give none; special added tokens none if `skip_special`).
  std::string decode(const int64_t* ids, int64_t n, bool skip_special) const;
  int64_t eos() const { return eos_; }  // the end-of-sequence id, -1 if none

 private:
  enum class Split { Gpt2, Gpt2Digits, Qwen2, Sentencepiece };
  struct Range {
    const int32_t* rows = nullptr;  // [n, 2] inclusive code point ranges, ascending
    int64_t n = 0;
    bool contains(uint32_t cp) const;
  };

  // NFC (Unicode's canonical decomposition, ordering and composition) from the file's tables; off when absent.
  struct Nfc {
    const int32_t* decompositions = nullptr;  // [n, 5]: code point, its decomposition (-1 after)
    int64_t n_decompositions = 0;
    const int32_t* classes = nullptr;  // [n, 2]: code point, combining class
    int64_t n_classes = 0;
    const int32_t* compositions = nullptr;  // [n, 3]: first, second, composite
    int64_t n_compositions = 0;
    bool enabled() const { return decompositions != nullptr; }
    std::vector<uint32_t> apply(const std::vector<uint32_t>& cps) const;

   private:
    int32_t combining_class(uint32_t cp) const;
    int64_t compose(uint32_t first, uint32_t second) const;  // -1: none
  };

  bool letter(uint32_t cp) const { return letters_.contains(cp); }
  bool number(uint32_t cp) const { return numbers_.contains(cp); }
  int64_t gpt2_piece(const std::vector<uint32_t>& cps, int64_t i, int64_t end) const;
  int64_t qwen2_piece(const std::vector<uint32_t>& cps, int64_t i, int64_t end) const;
  void plain(const std::string& text, std::vector<int64_t>& ids) const;  // text between added tokens
  void pre_tokenized(const std::string& text, const std::vector<uint32_t>& cps, const std::vector<int64_t>& at,
                     std::vector<int64_t>& ids) const;
  void bpe(const uint8_t* bytes, int64_t n, std::vector<int64_t>& ids) const;  // a piece's bytes
  void sentencepiece(const std::vector<uint32_t>& cps, std::vector<int64_t>& ids) const;  // a piece's code points
  void merge(std::vector<int32_t> start, std::vector<int64_t>& ids) const;  // BPE from the start symbols
  bool special(int64_t id) const;
  bool byte_token(int64_t id) const;  // one of byte_ids_

  std::shared_ptr<const bitquilt_standalone::MappedFile> file_;
  const uint8_t* token_bytes_;
  const int64_t* token_ends_;
  int64_t tokens_;  // ids 0 .. tokens_ - 1 have entries (empty where the id is unused)
  const int32_t* byte_ids_;
  const int32_t* chars_ = nullptr;  // [chars_n_, 2]: code point, its one-character token; sorted (SentencePiece)
  int64_t chars_n_ = 0;
  const int32_t* merges_;  // [merges_n_, 4]: left, right, rank, merged; sorted by (left, right)
  int64_t merges_n_;
  const int32_t* added_;  // [added_n_, 2]: id, special; sorted by id
  int64_t added_n_;
  std::vector<std::string> added_text_;  // the added tokens' bytes, as added_
  Range letters_, numbers_;
  Nfc nfc_;
  Split split_;
  std::vector<int64_t> prefix_, suffix_;
  int64_t eos_ = -1;
};

// `bytes` with every ill-formed UTF-8 sequence (each maximal subpart) replaced by U+FFFD, as Rust's
// String::from_utf8_lossy (the `tokenizers` decoder) and Python's "replace" do.
std::string utf8_lossy(const std::string& bytes);

}  // namespace bitquilt_tokenizer
