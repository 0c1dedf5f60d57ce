#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "memplan/common/json_util.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"

using namespace memplan;

TEST_CASE("sizes with units") {
  CHECK(*ParseBytes("141GiB") == 141LL * 1024 * 1024 * 1024);
  CHECK(*ParseBytes("80 GB") == 80'000'000'000LL);
  CHECK(*ParseBytes("1.5KiB") == 1536);
  CHECK(*ParseBytes("512") == 512);
  CHECK(*ParseBytes("3B") == 3);
  CHECK_FALSE(ParseBytes("-1GiB").ok());
  CHECK_FALSE(ParseBytes("12 parsecs").ok());
  CHECK_FALSE(ParseBytes("GiB").ok());
  CHECK_FALSE(ParseBytes("0").ok());
  CHECK_FALSE(ParseBytes("99999999PiB").ok());
  CHECK(ParseBytes("1x").error().message.find("expected a size") != std::string::npos);
}

TEST_CASE("bandwidths and FLOP rates") {
  CHECK(*ParseBandwidth("4.8TB/s") == doctest::Approx(4.8e12));
  CHECK(*ParseBandwidth("50 GiB/s") == doctest::Approx(50.0 * 1024 * 1024 * 1024));
  CHECK_FALSE(ParseBandwidth("4.8TB").ok());  // a size is not a rate
  CHECK_FALSE(ParseBandwidth("fast").ok());
  CHECK(*ParseFlopRate("989TFLOP/s") == doctest::Approx(989e12));
  CHECK(*ParseFlopRate("2.25PFLOP/s") == doctest::Approx(2.25e15));
  CHECK_FALSE(ParseFlopRate("989T").ok());
}

TEST_CASE("checked arithmetic refuses overflow") {
  CHECK(CheckedMul(1LL << 31, 1LL << 31, "x") == (1LL << 62));
  CHECK_THROWS_AS(CheckedMul(1LL << 40, 1LL << 40, "bytes"), ErrorException);
  CHECK_THROWS_AS(CheckedAdd(INT64_MAX, 1, "bytes"), ErrorException);
}

TEST_CASE("JSON pointers escape ~ and /") {
  CHECK(PointerAppend("", "arch") == "/arch");
  CHECK(PointerAppend("/a", "b/c~d") == "/a/b~1c~0d");
  CHECK(PointerAppend("/list", size_t{3}) == "/list/3");
  CHECK(JsonLocation{"m.json", ""}.Describe() == "m.json: /");
}

TEST_CASE("ObjectReader: ranges, enums, unknown keys") {
  Json j = Json::parse(R"({"n": 5, "big": 1e15, "s": "x", "e": "b", "f": 1.5, "extra": 1})");
  ObjectReader r(j, {"f.json", "/obj"});
  CHECK(r.Int("n", 1, 10) == 5);
  try {
    r.Int("big", 1, 100000);
    FAIL("expected a range error");
  } catch (const ErrorException& e) {
    CHECK(e.error().message == "f.json: /obj/big: expected an integer in [1, 100000], got 1e+15");
  }
  CHECK_THROWS(r.Int("f", 0, 10));  // 1.5 is not an integer
  CHECK(r.Enum("e", {"a", "b"}) == "b");
  CHECK_THROWS(r.Enum("s", {"a", "b"}));
  CHECK(r.Int("missing", 0, 9, 7) == 7);
  try {
    r.Finish();
    FAIL("expected unknown key");
  } catch (const ErrorException& e) {
    CHECK(e.error().message.find("f.json: /obj/extra: unknown key \"extra\"") == 0);
  }
}

TEST_CASE("sha256 known answer") {
  CHECK(Sha256Hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_CASE("atomic write leaves no temporary behind") {
  auto dir = std::filesystem::temp_directory_path() / "memplan_common_test";
  std::filesystem::create_directories(dir);
  auto path = (dir / "out.json").string();
  REQUIRE(WriteFileAtomic(path, "{}\n").ok());
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  CHECK(s == "{}");
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 1);
  CHECK_FALSE(WriteFileAtomic((dir / "no/such/dir/x.json").string(), "{}").ok());
  std::filesystem::remove_all(dir);
}

TEST_CASE("tables align numbers right") {
  Table t({"name", "GiB"});
  t.AddRow({"a", "1.00"});
  t.AddRow({"long", "123.45"});
  std::string out = t.Render();
  CHECK(out ==
        "name     GiB\n"
        "------------\n"
        "a       1.00\n"
        "long  123.45\n");
}
