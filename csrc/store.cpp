#include "store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "bitpack.h"
#include "crc32c.h"

namespace moe_rl {

namespace fs = std::filesystem;

namespace {

constexpr uint32_t kMaxUid = 4096;
constexpr uint32_t kMaxVersions = 4096;
constexpr uint32_t kMaxBody = 8 + 4 + 8 + 4 + 4 + kMaxUid + 4 + 8 * kMaxVersions;

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

template <typename V>
void put(std::vector<uint8_t>& b, V v) {
  const size_t at = b.size();
  b.resize(at + sizeof(V));
  std::memcpy(b.data() + at, &v, sizeof(V));
}

template <typename V>
V get_at(const uint8_t* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

void write_all(int fd, const uint8_t* p, size_t n, uint64_t off, const std::string& path) {
  while (n) {
    const ssize_t w = ::pwrite(fd, p, n, off_t(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_errno("write " + path);
    }
    p += w;
    n -= size_t(w);
    off += uint64_t(w);
  }
}

uint64_t file_size(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno("stat " + path);
  return uint64_t(st.st_size);
}

}  // namespace

class Mapping {
 public:
  Mapping(const std::string& path, uint64_t need) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw_errno("open " + path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw_errno("stat " + path);
    }
    len_ = uint64_t(st.st_size);
    if (len_ < need) {
      ::close(fd);
      return;  // caller reports the truncation
    }
    void* a = ::mmap(nullptr, len_, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (a == MAP_FAILED) throw_errno("mmap " + path);
    addr_ = static_cast<const uint8_t*>(a);
  }
  ~Mapping() {
    if (addr_) ::munmap(const_cast<uint8_t*>(addr_), len_);
  }
  const uint8_t* data() const { return addr_; }
  uint64_t size() const { return len_; }

 private:
  const uint8_t* addr_ = nullptr;
  uint64_t len_ = 0;
};

Store::Store(const std::string& dir, int num_layers, int top_k, int num_experts, bool writable,
             uint64_t segment_bytes)
    : dir_(dir),
      L_(num_layers),
      K_(top_k),
      E_(num_experts),
      B_(bits_for(num_experts)),
      writable_(writable),
      segment_limit_(segment_bytes) {
  if (L_ < 1 || K_ < 1) throw std::invalid_argument("num_layers and top_k must be >= 1");
  if (K_ > E_) throw std::invalid_argument("top_k must be <= num_experts");
  if (writable_) {
    open_writer();
  } else {
    const std::string ipath = dir_ + "/index.bin";
    index_fd_ = ::open(ipath.c_str(), O_RDONLY | O_CLOEXEC);
    if (index_fd_ < 0) throw_errno("open " + ipath);
    parse_index(false);
  }
}

Store::~Store() {
  try {
    close();
  } catch (...) {
  }
}

std::string Store::segment_path(uint32_t seg) const {
  char name[32];
  std::snprintf(name, sizeof(name), "segment-%06u.bin", seg);
  return dir_ + "/" + name;
}

uint64_t Store::payload_bytes(uint64_t num_tokens) const {
  return packed_bytes(size_t(num_tokens) * size_t(L_) * size_t(K_), B_);
}

void Store::check_open() const {
  if (closed_) throw std::runtime_error("replay log " + dir_ + " is closed");
}

void Store::open_writer() {
  const std::string lpath = dir_ + "/LOCK";
  lock_fd_ = ::open(lpath.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) throw_errno("open " + lpath);
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(lock_fd_);
    lock_fd_ = -1;
    if (e == EWOULDBLOCK)
      throw std::runtime_error("replay log " + dir_ +
                               " already has a writer (LOCK is held); open it read-only");
    errno = e;
    throw_errno("flock " + lpath);
  }
  const std::string ipath = dir_ + "/index.bin";
  index_fd_ = ::open(ipath.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (index_fd_ < 0) throw_errno("open " + ipath);
  parse_index(true);

  // Active segment: the one holding the last record. Bytes after that record are a torn
  // append (no index entry was written) and are dropped, as are later segment files.
  uint64_t end = 0;
  active_seg_ = 0;
  if (!order_.empty()) {
    const RecordInfo& last = entries_.at(order_.back());
    active_seg_ = last.segment;
    end = last.offset + kHeader + payload_bytes(last.num_tokens);
  }
  for (const auto& de : fs::directory_iterator(dir_)) {
    unsigned id;
    const std::string name = de.path().filename().string();
    if (name.size() == 18 && std::sscanf(name.c_str(), "segment-%6u.bin", &id) == 1 &&
        id > active_seg_)
      fs::remove(de.path());
  }
  const std::string spath = segment_path(active_seg_);
  seg_fd_ = ::open(spath.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (seg_fd_ < 0) throw_errno("open " + spath);
  const uint64_t have = file_size(seg_fd_, spath);
  if (have > end && ::ftruncate(seg_fd_, off_t(end)) != 0) throw_errno("truncate " + spath);
  active_size_ = end;
}

size_t Store::parse_index(bool truncate_torn_tail) {
  const std::string ipath = dir_ + "/index.bin";
  const uint64_t fsize = file_size(index_fd_, ipath);
  if (fsize <= index_off_) return 0;
  std::vector<uint8_t> data(fsize - index_off_);
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t r =
        ::pread(index_fd_, data.data() + got, data.size() - got, off_t(index_off_ + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno("read " + ipath);
    }
    if (r == 0) break;
    got += size_t(r);
  }
  data.resize(got);

  size_t pos = 0, added = 0;
  auto corrupt = [&](const std::string& why) -> CorruptRecord {
    return CorruptRecord("replay log index " + ipath + " is corrupted at byte " +
                         std::to_string(index_off_ + pos) + ": " + why);
  };
  while (true) {
    const size_t left = data.size() - pos;
    if (left < 8) break;  // incomplete tail (or clean end)
    const uint32_t len = get_at<uint32_t>(&data[pos]);
    const uint32_t crc = get_at<uint32_t>(&data[pos + 4]);
    if (len > kMaxBody || len < 32) {
      // A tail of zeros (a torn write after a power loss) is not corruption of a record.
      if (std::all_of(data.begin() + pos, data.end(), [](uint8_t x) { return x == 0; })) break;
      throw corrupt("entry length " + std::to_string(len));
    }
    if (left - 8 < len) break;  // torn tail
    const uint8_t* b = &data[pos + 8];
    if (crc32c(0, b, len) != crc) {
      if (left - 8 == len) break;  // the last entry: torn write
      throw corrupt("entry fails its CRC32C check");
    }
    RecordInfo info;
    info.seq = get_at<uint64_t>(b);
    info.segment = get_at<uint32_t>(b + 8);
    info.offset = get_at<uint64_t>(b + 12);
    info.num_tokens = get_at<uint32_t>(b + 20);
    const uint32_t uid_len = get_at<uint32_t>(b + 24);
    if (uint64_t(28) + uid_len + 4 > len) throw corrupt("bad uid length");
    std::string uid(reinterpret_cast<const char*>(b + 28), uid_len);
    const uint32_t nv = get_at<uint32_t>(b + 28 + uid_len);
    if (uint64_t(32) + uid_len + 8ull * nv != len) throw corrupt("bad versions length");
    info.versions.resize(nv);
    if (nv) std::memcpy(info.versions.data(), b + 32 + uid_len, 8ull * nv);
    {
      std::lock_guard<std::mutex> g(state_mu_);
      if (info.seq != next_seq_)
        throw corrupt("sequence number " + std::to_string(info.seq) + ", expected " +
                      std::to_string(next_seq_));
      if (entries_.count(uid)) throw corrupt("uid '" + uid + "' appears twice");
      stats_.records += 1;
      stats_.tokens += info.num_tokens;
      const uint64_t pb = payload_bytes(info.num_tokens);
      stats_.payload_bytes += pb;
      stats_.record_bytes += pb + kHeader;
      stats_.index_bytes += 8 + len;
      stats_.segments = std::max<uint64_t>(stats_.segments, uint64_t(info.segment) + 1);
      next_seq_ += 1;
      order_.push_back(uid);
      entries_.emplace(std::move(uid), std::move(info));
    }
    pos += 8 + len;
    ++added;
  }
  index_off_ += pos;
  if (truncate_torn_tail && index_off_ < fsize) {
    if (::ftruncate(index_fd_, off_t(index_off_)) != 0) throw_errno("truncate " + ipath);
  }
  return added;
}

size_t Store::refresh() {
  std::lock_guard<std::mutex> wg(write_mu_);  // one parse at a time (readers never append)
  check_open();
  if (writable_) return 0;  // the writer's view is always current
  return parse_index(false);
}

template <typename T>
void Store::append(const std::string& uid, const T* ids, size_t num_tokens,
                   const std::vector<int64_t>& versions, bool check_duplicates) {
  std::lock_guard<std::mutex> wg(write_mu_);
  check_open();
  if (!writable_) throw std::runtime_error("replay log " + dir_ + " is open read-only");
  if (uid.size() > kMaxUid) throw std::invalid_argument("uid longer than 4096 bytes");
  if (versions.size() > kMaxVersions) throw std::invalid_argument("more than 4096 versions");
  if (num_tokens > 0xFFFFFFFFull) throw std::invalid_argument("record longer than 2^32 tokens");
  {
    std::lock_guard<std::mutex> g(state_mu_);
    if (entries_.count(uid)) throw std::invalid_argument("uid '" + uid + "' is already in the log");
  }
  const size_t R = size_t(L_) * size_t(K_);
  const size_t n = num_tokens * R;
  const uint64_t pbytes = payload_bytes(num_tokens);
  buf_.resize(kHeader + pbytes);
  uint8_t* payload = buf_.data() + kHeader;
  const uint64_t mx = pack(ids, n, B_, payload);
  auto where = [&](size_t i) {
    return "ids[" + std::to_string(i / R) + ", " + std::to_string((i % R) / K_) + ", " +
           std::to_string(i % K_) + "]";
  };
  if (mx >= uint64_t(E_)) {
    const int64_t i = first_out_of_range(ids, n, E_);
    throw std::invalid_argument(where(size_t(i)) + " = " + std::to_string(int64_t(ids[i])) +
                                " is out of range for num_experts=" + std::to_string(E_) +
                                " (uid '" + uid + "')");
  }
  if (check_duplicates && K_ > 1) {
    const int64_t r = first_duplicate_row(ids, num_tokens * L_, K_);
    if (r >= 0)
      throw std::invalid_argument("ids[" + std::to_string(r / L_) + ", " + std::to_string(r % L_) +
                                  ", :] repeats an expert id (uid '" + uid +
                                  "'); a router's top-k ids are distinct");
  }
  const uint64_t seq = next_seq_;
  const uint32_t head[3] = {kMagic, uint32_t(seq), uint32_t(num_tokens)};
  std::memcpy(buf_.data(), head, 12);
  uint32_t crc = crc32c(0, uid.data(), uid.size());
  crc = crc32c(crc, buf_.data(), 12);
  crc = crc32c(crc, payload, pbytes);
  std::memcpy(buf_.data() + 12, &crc, 4);

  if (active_size_ > 0 && active_size_ + buf_.size() > segment_limit_) {
    const uint32_t next = active_seg_ + 1;
    const std::string spath = segment_path(next);
    const int fd = ::open(spath.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw_errno("open " + spath);
    ::close(seg_fd_);
    seg_fd_ = fd;
    active_seg_ = next;
    active_size_ = 0;
  }
  const std::string spath = segment_path(active_seg_);
  const uint64_t at = active_size_;
  try {
    write_all(seg_fd_, buf_.data(), buf_.size(), at, spath);
  } catch (...) {
    (void)::ftruncate(seg_fd_, off_t(at));
    throw;
  }
  if (after_record_hook_) after_record_hook_();

  std::vector<uint8_t> e;
  e.reserve(64 + uid.size() + 8 * versions.size());
  put<uint32_t>(e, 0);
  put<uint32_t>(e, 0);
  put<uint64_t>(e, seq);
  put<uint32_t>(e, active_seg_);
  put<uint64_t>(e, at);
  put<uint32_t>(e, uint32_t(num_tokens));
  put<uint32_t>(e, uint32_t(uid.size()));
  e.insert(e.end(), uid.begin(), uid.end());
  put<uint32_t>(e, uint32_t(versions.size()));
  for (int64_t v : versions) put<int64_t>(e, v);
  const uint32_t blen = uint32_t(e.size() - 8);
  const uint32_t bcrc = crc32c(0, e.data() + 8, blen);
  std::memcpy(e.data(), &blen, 4);
  std::memcpy(e.data() + 4, &bcrc, 4);
  try {
    write_all(index_fd_, e.data(), e.size(), index_off_, dir_ + "/index.bin");
  } catch (...) {
    (void)::ftruncate(index_fd_, off_t(index_off_));
    (void)::ftruncate(seg_fd_, off_t(at));
    throw;
  }

  std::lock_guard<std::mutex> g(state_mu_);
  RecordInfo info;
  info.seq = seq;
  info.segment = active_seg_;
  info.offset = at;
  info.num_tokens = uint32_t(num_tokens);
  info.versions = versions;
  entries_.emplace(uid, std::move(info));
  order_.push_back(uid);
  next_seq_ += 1;
  active_size_ += buf_.size();
  index_off_ += e.size();
  stats_.records += 1;
  stats_.tokens += num_tokens;
  stats_.payload_bytes += pbytes;
  stats_.record_bytes += pbytes + kHeader;
  stats_.index_bytes += e.size();
  stats_.segments = std::max<uint64_t>(stats_.segments, uint64_t(active_seg_) + 1);
  if (buf_.capacity() > (64u << 20)) std::vector<uint8_t>().swap(buf_);
}

void Store::sync() {
  std::lock_guard<std::mutex> wg(write_mu_);
  check_open();
  if (!writable_) return;
  if (::fsync(seg_fd_) != 0) throw_errno("fsync " + segment_path(active_seg_));
  if (::fsync(index_fd_) != 0) throw_errno("fsync " + dir_ + "/index.bin");
}

void Store::close() {
  std::lock_guard<std::mutex> wg(write_mu_);
  if (closed_) return;
  closed_ = true;
  if (seg_fd_ >= 0) ::close(seg_fd_);
  if (index_fd_ >= 0) ::close(index_fd_);
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
  seg_fd_ = index_fd_ = lock_fd_ = -1;
  std::lock_guard<std::mutex> g(state_mu_);
  maps_.clear();
}

bool Store::contains(const std::string& uid) {
  std::lock_guard<std::mutex> g(state_mu_);
  return entries_.count(uid) != 0;
}

size_t Store::size() {
  std::lock_guard<std::mutex> g(state_mu_);
  return order_.size();
}

std::vector<std::string> Store::uids() {
  std::lock_guard<std::mutex> g(state_mu_);
  return order_;
}

RecordInfo Store::info(const std::string& uid) {
  std::lock_guard<std::mutex> g(state_mu_);
  auto it = entries_.find(uid);
  if (it == entries_.end()) throw NotFound(uid);
  return it->second;
}

StoreStats Store::stats() {
  std::lock_guard<std::mutex> g(state_mu_);
  return stats_;
}

std::shared_ptr<Mapping> Store::map_for(const std::string& uid, uint32_t seg, uint64_t end) {
  std::lock_guard<std::mutex> g(state_mu_);
  auto it = maps_.find(seg);
  if (it != maps_.end() && it->second->size() >= end) return it->second;
  const std::string spath = segment_path(seg);
  auto m = std::make_shared<Mapping>(spath, end);
  if (m->size() < end)
    throw CorruptRecord("record for uid '" + uid + "' in segment " + spath +
                        " is truncated: the segment has " + std::to_string(m->size()) +
                        " bytes, the record ends at byte " + std::to_string(end));
  maps_[seg] = m;
  return m;
}

template <typename O>
void Store::read(const std::string& uid, O* out, size_t t0, size_t t1, bool layer_major,
                 size_t out_rows, size_t dst_row) {
  check_open();
  const RecordInfo info = this->info(uid);
  if (t0 > t1 || t1 > info.num_tokens)
    throw std::out_of_range("token range [" + std::to_string(t0) + ", " + std::to_string(t1) +
                            ") outside record of " + std::to_string(info.num_tokens) +
                            " tokens (uid '" + uid + "')");
  if (layer_major && dst_row + (t1 - t0) > out_rows)
    throw std::out_of_range("destination rows out of range");
  const uint64_t pbytes = payload_bytes(info.num_tokens);
  const uint64_t end = info.offset + kHeader + pbytes;
  std::shared_ptr<Mapping> m = map_for(uid, info.segment, end);
  const uint8_t* rec = m->data() + info.offset;
  const std::string where = "record for uid '" + uid + "' in segment " +
                            segment_path(info.segment) + " at byte " + std::to_string(info.offset);
  const uint32_t magic = get_at<uint32_t>(rec), seq = get_at<uint32_t>(rec + 4),
                 ntok = get_at<uint32_t>(rec + 8), crc = get_at<uint32_t>(rec + 12);
  if (magic != kMagic || seq != uint32_t(info.seq) || ntok != info.num_tokens)
    throw CorruptRecord(where + " has a damaged header");
  uint32_t c = crc32c(0, uid.data(), uid.size());
  c = crc32c(c, rec, 12);
  c = crc32c(c, rec + kHeader, pbytes);
  if (c != crc) throw CorruptRecord(where + " fails its CRC32C check");

  const uint8_t* payload = rec + kHeader;
  const size_t R = size_t(L_) * size_t(K_);
  if (!layer_major) {
    unpack(payload, pbytes, t0 * R, (t1 - t0) * R, B_, out);
    return;
  }
  constexpr size_t kChunk = 64;
  std::vector<O> tmp(kChunk * R);
  for (size_t t = t0; t < t1; t += kChunk) {
    const size_t nt = std::min(kChunk, t1 - t);
    unpack(payload, pbytes, t * R, nt * R, B_, tmp.data());
    for (size_t i = 0; i < nt; ++i) {
      const size_t row = dst_row + (t - t0) + i;
      for (size_t l = 0; l < size_t(L_); ++l)
        std::memcpy(out + (l * out_rows + row) * K_, tmp.data() + i * R + l * K_, K_ * sizeof(O));
    }
  }
}

#define MOE_RL_INSTANTIATE_APPEND(T)                                                       \
  template void Store::append<T>(const std::string&, const T*, size_t,                    \
                                 const std::vector<int64_t>&, bool);
MOE_RL_INSTANTIATE_APPEND(int8_t)
MOE_RL_INSTANTIATE_APPEND(uint8_t)
MOE_RL_INSTANTIATE_APPEND(int16_t)
MOE_RL_INSTANTIATE_APPEND(uint16_t)
MOE_RL_INSTANTIATE_APPEND(int32_t)
MOE_RL_INSTANTIATE_APPEND(uint32_t)
MOE_RL_INSTANTIATE_APPEND(int64_t)
MOE_RL_INSTANTIATE_APPEND(uint64_t)
#undef MOE_RL_INSTANTIATE_APPEND
template void Store::read<int32_t>(const std::string&, int32_t*, size_t, size_t, bool, size_t,
                                   size_t);
template void Store::read<int64_t>(const std::string&, int64_t*, size_t, size_t, bool, size_t,
                                   size_t);

}  // namespace moe_rl
