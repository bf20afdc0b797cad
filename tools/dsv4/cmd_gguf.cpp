// dsv4 gguf: inspect and rewrite GGUF files (development tools; docs/GGUF.md).
//   dsv4 gguf dump FILE [--json] [--tensor-data-hash]   metadata and tensor infos
//   dsv4 gguf copy IN OUT [--alignment N] [--split-max-tensors N] [--split-max-bytes N[K|M|G]]
//                  [--overwrite]                         re-align, split or merge a file
// tests/python/test_gguf_interop.py drives both to check the reader and the writer against
// the Python gguf package.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "gguf/gguf_file.h"
#include "gguf/gguf_split.h"
#include "gguf/gguf_writer.h"

namespace dsv4::cli {
namespace {

using gguf::Value;
using gguf::ValueType;

struct DumpOptions {
  std::string file;
  bool json = false;
  bool hash = false;
};

struct CopyOptions {
  std::string input;
  std::string output;
  uint64_t alignment = 0;  // 0: keep the input's
  uint64_t split_max_tensors = 0;
  std::string split_max_bytes;
  bool overwrite = false;
};

// CRC-32 (IEEE, as zlib.crc32), so the Python side can check tensor bytes cheaply.
uint32_t crc32(std::span<const uint8_t> bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (uint8_t b : bytes) c = table[(c ^ b) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

std::string type_label(const Value& v) {
  if (!v.is_array()) return std::string(gguf::value_type_name(v.type()));
  return fmt::format("array[{}]", gguf::value_type_name(v.elem_type()));
}

nlohmann::json value_json(const Value& v) {
  switch (v.type()) {
    case ValueType::UINT8:
    case ValueType::UINT16:
    case ValueType::UINT32:
    case ValueType::UINT64: return v.as_u64();
    case ValueType::INT8:
    case ValueType::INT16:
    case ValueType::INT32:
    case ValueType::INT64: return v.as_i64();
    case ValueType::FLOAT32:
    case ValueType::FLOAT64: return v.as_f64();
    case ValueType::BOOL: return v.as_bool();
    case ValueType::STRING: return v.as_string();
    case ValueType::ARRAY: {
      nlohmann::json items = nlohmann::json::array();
      for (const Value& item : v.as_array()) items.push_back(value_json(item));
      return items;
    }
  }
  return nullptr;
}

int dump_json(const gguf::GgufFile& f, bool hash) {
  nlohmann::json out;
  out["path"] = f.path();
  out["parts"] = f.part_paths();
  out["version"] = f.version();
  out["alignment"] = f.alignment();
  out["file_bytes"] = f.file_bytes();
  nlohmann::json metadata = nlohmann::json::array();
  for (const auto& [key, value] : f.metadata()) {
    nlohmann::json kv = {{"key", key}, {"type", gguf::value_type_name(value.type())}, {"value", value_json(value)}};
    if (value.is_array()) kv["elem_type"] = gguf::value_type_name(value.elem_type());
    metadata.push_back(std::move(kv));
  }
  out["metadata"] = std::move(metadata);
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : f.tensors()) {
    nlohmann::json j = {{"name", t.name},     {"type", ggml_type_name(t.type)}, {"type_id", static_cast<uint32_t>(t.type)},
                        {"ne", t.ne},         {"offset", t.offset},             {"nbytes", t.nbytes},
                        {"part", t.part}};
    if (hash) j["crc32"] = fmt::format("{:08x}", crc32(t.bytes()));
    tensors.push_back(std::move(j));
  }
  out["tensors"] = std::move(tensors);
  std::cout << out.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  return kExitOk;
}

int dump_text(const gguf::GgufFile& f, bool hash) {
  fmt::print("{}: GGUF v{}, {} part(s), {} bytes, alignment {}\n", f.path(), f.version(), f.part_paths().size(),
             f.file_bytes(), f.alignment());
  fmt::print("metadata ({} keys):\n", f.metadata().size());
  for (const auto& [key, value] : f.metadata())
    fmt::print("  {:<48} {:<14} {}\n", key, type_label(value), value.to_display_string());
  fmt::print("tensors ({}):\n", f.tensors().size());
  for (const auto& t : f.tensors()) {
    fmt::print("  {:<48} {:<8} {:<22} part {} offset {} bytes {}", t.name, ggml_type_name(t.type), t.shape_string(),
               t.part, t.offset, t.nbytes);
    if (hash) fmt::print(" crc32 {:08x}", crc32(t.bytes()));
    fmt::print("\n");
  }
  return kExitOk;
}

int run_dump(const DumpOptions& o) {
  // Without hashes only the headers are read, so this is instant on any size of file.
  gguf::OpenOptions open;
  open.map_data = o.hash;
  auto f = gguf::GgufFile::open(o.file, open);
  if (!f) {
    fmt::print(stderr, "dsv4 gguf dump: {}\n", f.status().message());
    return kExitFailure;
  }
  return o.json ? dump_json(*f, o.hash) : dump_text(*f, o.hash);
}

Result<uint64_t> parse_size(const std::string& text) {
  if (text.empty()) return uint64_t{0};
  uint64_t scale = 1;
  std::string digits = text;
  switch (text.back()) {
    case 'K': case 'k': scale = uint64_t{1} << 10; digits.pop_back(); break;
    case 'M': case 'm': scale = uint64_t{1} << 20; digits.pop_back(); break;
    case 'G': case 'g': scale = uint64_t{1} << 30; digits.pop_back(); break;
    default: break;
  }
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 12)
    return Status::errorf("--split-max-bytes: '{}' is not a size (a number, optionally with K, M or G)", text);
  return std::stoull(digits) * scale;
}

Status copy_file(const CopyOptions& o, std::vector<std::string>& outputs) {
  DSV4_ASSIGN_OR_RETURN(auto in, gguf::GgufFile::open(o.input));
  DSV4_ASSIGN_OR_RETURN(uint64_t max_bytes, parse_size(o.split_max_bytes));
  gguf::WriterOptions wo;
  wo.alignment = o.alignment ? o.alignment : in.alignment();
  wo.split_max_tensors = o.split_max_tensors;
  wo.split_max_bytes = max_bytes;
  wo.overwrite = o.overwrite;
  gguf::GgufWriter out(o.output, wo);
  for (const auto& [key, value] : in.metadata()) {
    // The writer states the layout of what it writes: alignment and split keys are its own.
    if (key == "general.alignment" || key == gguf::kSplitNoKey || key == gguf::kSplitCountKey ||
        key == gguf::kSplitTensorsCountKey)
      continue;
    out.set(key, value);
  }
  for (const auto& t : in.tensors()) DSV4_TRY(out.add_tensor(t.name, t.type, t.ne));
  DSV4_TRY(out.begin());
  for (const auto& t : in.tensors()) DSV4_TRY(out.write_tensor_data(t.bytes()));
  DSV4_TRY(out.finish());
  outputs = out.output_paths();
  return Status::ok();
}

int run_copy(const CopyOptions& o) {
  std::vector<std::string> outputs;
  if (Status s = copy_file(o, outputs); !s) {
    fmt::print(stderr, "dsv4 gguf copy: {}\n", s.message());
    return kExitFailure;
  }
  for (const auto& p : outputs) fmt::print("{}\n", p);
  return kExitOk;
}

}  // namespace

void register_gguf(CLI::App& app, CommandRunner& run) {
  app.require_subcommand(1);
  auto dump = std::make_shared<DumpOptions>();
  CLI::App* dump_cmd = app.add_subcommand("dump", "Print a GGUF file's metadata and tensor infos");
  dump_cmd->add_option("file", dump->file, "GGUF file (any part of a split set)")->required();
  dump_cmd->add_flag("--json", dump->json, "machine-readable output");
  dump_cmd->add_flag("--tensor-data-hash", dump->hash, "add the CRC-32 of each tensor's bytes (reads all data)");

  auto copy = std::make_shared<CopyOptions>();
  CLI::App* copy_cmd = app.add_subcommand("copy", "Rewrite a GGUF file: change alignment, split or merge parts");
  copy_cmd->add_option("input", copy->input, "GGUF file (any part of a split set)")->required();
  copy_cmd->add_option("output", copy->output, "output path (split parts are named <stem>-0000K-of-0000N.gguf)")
      ->required();
  copy_cmd->add_option("--alignment", copy->alignment, "data alignment in bytes (default: the input's)");
  copy_cmd->add_option("--split-max-tensors", copy->split_max_tensors, "at most this many tensors per part");
  copy_cmd->add_option("--split-max-bytes", copy->split_max_bytes, "at most this much tensor data per part (K/M/G)");
  copy_cmd->add_flag("--overwrite", copy->overwrite, "replace existing output files");

  run = [dump, copy, dump_cmd, copy_cmd] {
    if (dump_cmd->parsed()) return run_dump(*dump);
    if (copy_cmd->parsed()) return run_copy(*copy);
    return static_cast<int>(kExitUsage);
  };
}

}  // namespace dsv4::cli
