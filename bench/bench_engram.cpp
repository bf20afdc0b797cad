// Cost per token of V4.1's Engram row reads on the CPU (model/engram_table.h): one token
// reads 48 rows of 264 bytes (24 per Engram layer, FP8 codes + E8M0 scales) from tables
// that stay in the file. A 1 GiB table (4M rows; the release's are 101 GB each) is written
// once to DSV4_BENCH_DIR (default: the working directory, which should be on disk, not
// tmpfs). Cases:
//   read/pread/cold     page cache dropped before every token (posix_fadvise DONTNEED): disk
//   read/pread/warm     the table in page cache, pread on the table's own descriptor
//   read/mapped/warm    the table in page cache, through the file mapping
//   gather/mapped/warm  a 512-token prefill step through EngramGather (hash + read on a
//                       worker thread), per token
// Rows are random (the hash spreads a step's rows over the whole table). Reported time is
// per token; items/s counts tokens.
//   build/bench/bench_engram --benchmark_min_time=0.5
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "model/engram.h"
#include "model/engram_table.h"

namespace {

using namespace dsv4;

constexpr uint32_t kDim = 256;
constexpr uint64_t kRows = 4u << 20;
constexpr uint64_t kRowsPerToken = 48;

std::filesystem::path table_path() {
  const char* dir = std::getenv("DSV4_BENCH_DIR");
  return std::filesystem::path(dir ? dir : ".") / "bench_engram_table.gguf";
}

// The table file, written on first use (random codes, sane scales).
const gguf::GgufFile& table_file() {
  static const gguf::GgufFile file = [] {
    const auto path = table_path();
    if (!std::filesystem::exists(path)) {
      gguf::GgufWriter w(path.string());
      w.set("general.architecture", gguf::Value::string("bench"));
      (void)w.add_tensor("blk.1.engram_embd.weight", GgmlType::I8, {engram_row_bytes(kDim), kRows});
      (void)w.begin();
      std::mt19937_64 rng(7);
      std::vector<uint8_t> chunk(engram_row_bytes(kDim) * 65536);
      for (uint64_t r = 0; r < kRows; r += 65536) {
        for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<uint8_t>(rng() % 0x7e);
        for (size_t row = 0; row < 65536; ++row)
          for (uint32_t s = 0; s < kDim / 32; ++s) chunk[row * engram_row_bytes(kDim) + kDim + s] = 120;
        (void)w.write_tensor_data(chunk);
      }
      (void)w.finish();
    }
    return gguf::GgufFile::open(path.string()).value();
  }();
  return file;
}

EngramTable open_table(EngramTable::Access access) {
  const gguf::GgufFile& f = table_file();
  return EngramTable::open(f, *f.find_tensor("blk.1.engram_embd.weight"), kDim, access).value();
}

std::vector<uint32_t> random_rows(std::mt19937_64& rng, size_t n) {
  std::vector<uint32_t> ids(n);
  for (auto& id : ids) id = static_cast<uint32_t>(rng() % kRows);
  return ids;
}

void drop_page_cache() {
  const int fd = ::open(table_path().c_str(), O_RDONLY);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void warm_up() {
  EngramTable t = open_table(EngramTable::Access::Pread);
  std::vector<uint8_t> buf(t.row_bytes() * 65536);
  std::vector<uint32_t> ids(65536);
  for (uint64_t r = 0; r < kRows; r += 65536) {
    for (uint32_t i = 0; i < 65536; ++i) ids[i] = static_cast<uint32_t>(r + i);
    (void)t.read_raw(ids, buf);
  }
}

void BM_ReadPreadCold(benchmark::State& state) {
  EngramTable t = open_table(EngramTable::Access::Pread);
  std::mt19937_64 rng(1);
  std::vector<float> out(kRowsPerToken * kDim);
  for (auto _ : state) {
    state.PauseTiming();
    drop_page_cache();
    const auto ids = random_rows(rng, kRowsPerToken);
    state.ResumeTiming();
    if (!t.read(ids, out).is_ok()) state.SkipWithError("read failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * kRowsPerToken * t.row_bytes());
}

void BM_ReadWarm(benchmark::State& state, EngramTable::Access access) {
  warm_up();
  EngramTable t = open_table(access);
  std::mt19937_64 rng(2);
  std::vector<float> out(kRowsPerToken * kDim);
  std::vector<std::vector<uint32_t>> batches;
  for (int i = 0; i < 4096; ++i) batches.push_back(random_rows(rng, kRowsPerToken));
  size_t i = 0;
  for (auto _ : state) {
    if (!t.read(batches[i++ % batches.size()], out).is_ok()) state.SkipWithError("read failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * kRowsPerToken * t.row_bytes());
}

// Two layers of 24 columns over the same table file, as V4.1-Flash's two tables would be.
void BM_GatherPrefill(benchmark::State& state) {
  warm_up();
  EngramConfig e;
  e.layers = {1, 14};
  e.dim = kDim;
  e.ngram = 4;
  e.heads = 8;
  e.hash_vocab_size = kRows / 48;  // 2 x 24 buckets over the table's rows
  e.compressed_vocab_size = 99092;
  e.pad_token_id = 2;
  EngramHashConstants k = compute_engram_hash_constants(e).value();
  std::vector<int32_t> map(129280);
  for (size_t i = 0; i < map.size(); ++i) map[i] = static_cast<int32_t>(i % 99092);
  EngramHasher hasher = EngramHasher::create(e, std::move(k), std::move(map)).value();
  std::vector<EngramTable> tables;
  tables.push_back(open_table(EngramTable::Access::Mapped));
  tables.push_back(open_table(EngramTable::Access::Mapped));
  EngramGather gather(hasher, tables);
  std::mt19937_64 rng(3);
  std::vector<int32_t> tokens(512);
  EngramHasher::History hist = hasher.start();
  for (auto _ : state) {
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % 129280);
    if (!gather.start(hist, tokens).is_ok() || !gather.wait().is_ok()) state.SkipWithError("gather failed");
    benchmark::DoNotOptimize(gather.rows(1).data());
  }
  state.SetItemsProcessed(state.iterations() * tokens.size());
}

BENCHMARK(BM_ReadPreadCold)->Name("read/pread/cold")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_ReadWarm, pread, EngramTable::Access::Pread)->Name("read/pread/warm")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_ReadWarm, mapped, EngramTable::Access::Mapped)->Name("read/mapped/warm")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GatherPrefill)->Name("gather/mapped/warm/512")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
