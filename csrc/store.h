// Append-only routing-record store: segment files of records plus one index file.
//
// Directory layout (format version 1, little-endian):
//   LOCK                 flock()ed by the single writer; readers never take it.
//   index.bin            one entry per record, appended after the record itself:
//                          u32 body_len | u32 crc32c(body) | body
//                          body = u64 seq | u32 segment | u64 offset | u32 num_tokens |
//                                 u32 uid_len | uid bytes | u32 n_versions | i64 versions[]
//   segment-NNNNNN.bin   records back to back:
//                          u32 magic "RRC1" | u32 seq (low 32 bits) | u32 num_tokens |
//                          u32 crc32c(uid || first 12 header bytes || payload) | payload
//                        payload = the record's ids [tokens, layers, top_k] bit-packed
//                        (bitpack.h), ceil(tokens*layers*top_k*bits/8) bytes.
//
// So a record costs 16 bytes beyond its packed bits in the segment, and its uid and versions
// live in the index (about 40 bytes + uid + 8 per version). The CRC covers the uid too, so a
// record can never be returned for the wrong key.
//
// Crash safety: the writer writes the record, then its index entry. A record is visible only
// once its index entry is complete and passes its CRC. On reopen the writer truncates a torn
// index tail and any unindexed bytes at the end of the active segment (the record that was
// being written when the process died); every earlier record is kept. Readers stop at an
// incomplete tail and pick it up on refresh(). A corrupted index entry that is not the tail,
// or a record failing its CRC, raises CorruptRecord (never returns wrong ids).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace moe_rl {

struct CorruptRecord : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct NotFound : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct RecordInfo {
  uint64_t seq = 0;
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint32_t num_tokens = 0;
  std::vector<int64_t> versions;
};

struct StoreStats {
  uint64_t records = 0, tokens = 0, payload_bytes = 0, record_bytes = 0, index_bytes = 0;
  uint64_t segments = 0;
};

class Mapping;

class Store {
 public:
  static constexpr uint32_t kMagic = 0x31435252u;  // "RRC1" little-endian
  static constexpr size_t kHeader = 16;

  Store(const std::string& dir, int num_layers, int top_k, int num_experts, bool writable,
        uint64_t segment_bytes);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  int num_layers() const { return L_; }
  int top_k() const { return K_; }
  int num_experts() const { return E_; }
  int bits() const { return B_; }
  bool writable() const { return writable_; }
  bool closed() const { return closed_; }
  const std::string& dir() const { return dir_; }

  // Writer only. ids: [num_tokens, layers, top_k] C-contiguous. Throws std::invalid_argument
  // for an id out of [0, num_experts), a repeated id in a row (if check_duplicates), or a uid
  // already in the log.
  template <typename T>
  void append(const std::string& uid, const T* ids, size_t num_tokens,
              const std::vector<int64_t>& versions, bool check_duplicates);
  void sync();  // fsync the active segment and the index
  void close();
  // Fault injection (moe_rl/faults.py, point routing.append): called by append after a record
  // is written and before its index entry is; empty (the default) costs one branch.
  void set_after_record_hook(std::function<void()> hook) { after_record_hook_ = std::move(hook); }

  // Reads index entries appended since the last call (readers); returns how many.
  size_t refresh();
  bool contains(const std::string& uid);
  size_t size();
  std::vector<std::string> uids();
  RecordInfo info(const std::string& uid);  // throws NotFound
  StoreStats stats();
  std::string segment_path(uint32_t seg) const;

  // Verifies the record's CRC, then decodes tokens [t0, t1) of it. If layer_major, out is
  // [layers, out_rows, top_k] and token t0+i goes to row dst_row+i of every layer; otherwise
  // out is [t1-t0, layers, top_k]. Safe to call without the GIL.
  template <typename O>
  void read(const std::string& uid, O* out, size_t t0, size_t t1, bool layer_major,
            size_t out_rows, size_t dst_row);

 private:
  void open_writer();
  size_t parse_index(bool truncate_torn_tail);
  std::shared_ptr<Mapping> map_for(const std::string& uid, uint32_t seg, uint64_t end);
  void check_open() const;
  uint64_t payload_bytes(uint64_t num_tokens) const;

  std::string dir_;
  int L_, K_, E_, B_;
  bool writable_;
  uint64_t segment_limit_;
  bool closed_ = false;

  int lock_fd_ = -1, index_fd_ = -1, seg_fd_ = -1;
  uint32_t active_seg_ = 0;
  uint64_t active_size_ = 0;
  uint64_t index_off_ = 0;  // bytes of index.bin parsed (and, for the writer, written)
  uint64_t next_seq_ = 0;

  std::mutex state_mu_;  // entries_, order_, maps_, counters
  std::mutex write_mu_;  // serialises appends, and a reader's index parsing
  std::unordered_map<std::string, RecordInfo> entries_;
  std::vector<std::string> order_;
  std::function<void()> after_record_hook_;
  std::unordered_map<uint32_t, std::shared_ptr<Mapping>> maps_;
  std::vector<uint8_t> buf_;
  StoreStats stats_;
};

}  // namespace moe_rl
