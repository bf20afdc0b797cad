#include "util/status.h"

#include <gtest/gtest.h>

namespace dsv4 {
namespace {

TEST(Status, CarriesCodeAndMessage) {
  const Status ok = Status::ok();
  EXPECT_TRUE(ok.is_ok());
  EXPECT_EQ(ok.code(), StatusCode::kOk);
  const Status plain = Status::error("bad input");
  EXPECT_EQ(plain.code(), StatusCode::kInvalidArgument);
  const Status full = Status::errorf(StatusCode::kResourceExhausted, "budget: {} of {} bytes", 7, 5);
  EXPECT_FALSE(full.is_ok());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(), "budget: 7 of 5 bytes");
  const Status ctx = full.with_context("seq 3");
  EXPECT_EQ(ctx.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ctx.message(), "seq 3: budget: 7 of 5 bytes");
  EXPECT_EQ(status_code_name(StatusCode::kOutOfRange), "out of range");
}

TEST(Status, ResultKeepsTheCode) {
  const Result<int> r = Status::error(StatusCode::kIo, "disk");
  EXPECT_EQ(r.status().code(), StatusCode::kIo);
  const Result<int> v = 3;
  EXPECT_EQ(v.status().code(), StatusCode::kOk);
}

// The formatter CUDA translation units use instead of fmt.
TEST(Status, StreamFormatSubstitutesInOrder) {
  EXPECT_EQ(detail::stream_format("a={} b={} c={}", 1, 2.5, std::string("x")), "a=1 b=2.5 c=x");
  EXPECT_EQ(detail::stream_format("no placeholders", 1), "no placeholders");
  EXPECT_EQ(detail::stream_format("{} only one", 4, 5), "4 only one");
  EXPECT_EQ(detail::stream_format("tail {}", "s"), "tail s");
}

}  // namespace
}  // namespace dsv4
