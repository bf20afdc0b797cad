// dsv4 quant: development tools over the quantised block arithmetic of gguf/quant.h, used
// by the cross-checks against the Python `gguf` package (tests/python/test_quant_vs_gguf.py).
//   dsv4 quant dequant  --type q4_K IN.bin OUT.f32   raw blocks -> little-endian f32
//   dsv4 quant quantize --type q4_K IN.f32 OUT.bin   little-endian f32 -> raw blocks
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "gguf/ggml_types.h"
#include "gguf/quant.h"
#include "util/status.h"

namespace dsv4::cli {
namespace {

struct QuantOptions {
  std::string type;
  std::string input;
  std::string output;
};

Result<std::vector<char>> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot open for reading", path);
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::errorf("{}: read failed", path);
  return data;
}

Status write_all(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::errorf("{}: cannot open for writing", path);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) return Status::errorf("{}: write failed", path);
  return Status::ok();
}

Result<GgmlType> parse_type(const std::string& name, bool for_quantize) {
  const auto type = ggml_type_from_name(name);
  if (!type) return Status::errorf("--type {}: not a ggml type name (e.g. q8_0, q4_K, mxfp4, bf16)", name);
  if (!ggml_traits(*type).supported) return Status::errorf("--type {}: dsv4 does not decode this type", name);
  if (for_quantize && !can_quantize(*type))
    return Status::errorf("--type {}: no quantiser (types: f32 f16 bf16 q8_0 q2_K q3_K q4_K q5_K q6_K mxfp4)", name);
  return *type;
}

Status run_dequant(const QuantOptions& o) {
  DSV4_ASSIGN_OR_RETURN(const GgmlType type, parse_type(o.type, false));
  DSV4_ASSIGN_OR_RETURN(const auto bytes, read_all(o.input));
  const auto& traits = ggml_traits(type);
  if (bytes.size() % traits.block_bytes != 0)
    return Status::errorf("{}: {} bytes is not a whole number of {} blocks ({} bytes each)", o.input, bytes.size(),
                          traits.name, traits.block_bytes);
  const int64_t n = static_cast<int64_t>(bytes.size() / traits.block_bytes * traits.block_elems);
  std::vector<float> values(static_cast<size_t>(n));
  dequantize_row(type, bytes.data(), values.data(), n);
  return write_all(o.output, values.data(), values.size() * sizeof(float));
}

Status run_quantize(const QuantOptions& o) {
  DSV4_ASSIGN_OR_RETURN(const GgmlType type, parse_type(o.type, true));
  DSV4_ASSIGN_OR_RETURN(const auto bytes, read_all(o.input));
  const auto& traits = ggml_traits(type);
  if (bytes.size() % (sizeof(float) * traits.block_elems) != 0)
    return Status::errorf("{}: {} bytes is not a whole number of {}-element f32 blocks for {}", o.input,
                          bytes.size(), traits.block_elems, traits.name);
  const int64_t n = static_cast<int64_t>(bytes.size() / sizeof(float));
  std::vector<float> values(static_cast<size_t>(n));
  std::memcpy(values.data(), bytes.data(), bytes.size());
  std::vector<uint8_t> out(*ggml_row_bytes(type, static_cast<uint64_t>(n)));
  quantize_row(type, values.data(), out.data(), n);
  return write_all(o.output, out.data(), out.size());
}

int report(const Status& s) {
  if (s.is_ok()) return kExitOk;
  fmt::print(stderr, "dsv4 quant: {}\n", s.message());
  return kExitFailure;
}

}  // namespace

void register_quant(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<QuantOptions>();
  app.require_subcommand(1);
  CLI::App* dequant = app.add_subcommand("dequant", "Decode raw blocks of one type to little-endian f32");
  CLI::App* quantize = app.add_subcommand("quantize", "Encode little-endian f32 values as raw blocks of one type");
  for (CLI::App* sub : {dequant, quantize}) {
    sub->add_option("--type", o->type, "element type as ggml names it: f32 f16 bf16 i32 q8_0 q2_K..q6_K iq2_xxs mxfp4")
        ->required();
    sub->add_option("input", o->input, "input file")->required();
    sub->add_option("output", o->output, "output file (overwritten)")->required();
  }
  run = [o, dequant] { return report(dequant->parsed() ? run_dequant(*o) : run_quantize(*o)); };
}

}  // namespace dsv4::cli
