#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <vector>
#include <string>
#include <thread>
#include <stdexcept>
#include <filesystem>
#include <fstream>
#include <limits>

#include "memplan/common/parallel.h"
#include "memplan/common/cleanup.h"
#include "memplan/common/heap_tuning.h"
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

// --- Hostile input (docs/design.md, "Input limits and hostile input") -----

namespace {
std::string ParseMessage(std::string_view text, const JsonLimits& limits = {}) {
  auto j = ParseJsonText(text, "in.json", limits);
  return j.ok() ? std::string() : j.error().message;
}
}  // namespace

TEST_CASE("the JSON reader refuses what the parser alone would accept, at its pointer") {
  struct Case {
    std::string text;
    std::string message;
  } cases[] = {
      {R"({"a": {"b": 1, "b": 2}})", "in.json: /a/b: duplicate key \"b\""},
      {R"({"a": [1, 2, 1e99999]})", "in.json: /a/2: number out of range: 1e99999"},
      {R"({"a": [[1], -1e400]})", "in.json: /a/1: number out of range"},
      {R"({"n": "a\u0000b"})", "in.json: /n: string contains U+0000"},
      {R"({"a\u0000": 1})", "in.json: /a"},
      {std::string(R"({"x": [)") + std::string(100, '[') + std::string(100, ']') + "]}",
       "in.json: /x/0/0/0"},
      {R"({"a": 1,})", "in.json: /a: invalid JSON"},
      {R"({"s": ")" + std::string(70000, 'y') + "\"}", "in.json: /s: string of 70000 bytes exceeds the limit of 65536"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text.substr(0, 60));
    std::string m = ParseMessage(c.text);
    CHECK(m.starts_with(c.message));
    CHECK(m.find('\n') == std::string::npos);
  }
  // Depth: the limit, not the stack, decides; 10^6 levels cost no recursion.
  JsonLimits limits;
  CHECK(ParseMessage(std::string(64, '[') + std::string(64, ']'), limits).empty());
  CHECK(ParseMessage(std::string(65, '[') + std::string(65, ']'), limits).find("nesting deeper than 64") !=
        std::string::npos);
  CHECK(ParseMessage(std::string(1000000, '[') + std::string(1000000, ']')).find("nesting") != std::string::npos);
  // Size.
  limits.max_bytes = 10;
  CHECK(ParseMessage("[1, 2, 3, 4, 5]", limits) == "in.json: /: input exceeds the limit of 10 bytes");
  // A UTF-8 byte-order mark is skipped; the document is the same.
  auto bom = ParseJsonText("\xEF\xBB\xBF{\"a\": 1}", "in.json");
  REQUIRE(bom.ok());
  CHECK((*bom)["a"] == 1);
  // Well-formed documents come back intact, key order and all.
  auto ok = ParseJsonText(R"({"b": [1, 2.5, "x", null, true, {"c": {}}], "a": -3})", "in.json");
  REQUIRE(ok.ok());
  CHECK(ok->dump() == R"({"a":-3,"b":[1,2.5,"x",null,true,{"c":{}}]})");
}

TEST_CASE("explicit nulls are refused unless a key is documented nullable") {
  Json j = Json::parse(R"({"a": null, "b": null})");
  ObjectReader r(j, JsonLocation{"m.json", ""});
  CHECK(r.OptIntNullable("a", 0, 10) == std::nullopt);
  try {
    r.OptInt("b", 0, 10);
    FAIL("null accepted");
  } catch (const ErrorException& e) {
    CHECK(std::string(e.what()) == "m.json: /b: expected a value, got null (omit the key to use its default)");
  }
}

TEST_CASE("no non-finite number is ever written") {
  Json j = Json::parse(R"({"a": [1, {"b": 2.5}]})");
  CHECK_FALSE(FindNonFinite(j).has_value());
  j["a"][1]["b"] = std::numeric_limits<double>::infinity();
  CHECK(FindNonFinite(j) == std::optional<std::string>("/a/1/b"));
  OrderedJson o;
  o["x/y"] = std::nan("");
  CHECK(FindNonFinite(o) == std::optional<std::string>("/x~1y"));
}

TEST_CASE("outputs are all or nothing; links are written through, devices written straight") {
  namespace fs = std::filesystem;
  auto dir = fs::temp_directory_path() / ("memplan_output_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto count_entries = [&] {
    int n = 0;
    for ([[maybe_unused]] auto& e : fs::directory_iterator(dir)) ++n;
    return n;
  };
  {  // Nothing lands before Commit, nothing stays without it.
    OutputFiles out;
    REQUIRE(out.Stage((dir / "a.json").string(), "a").ok());
    REQUIRE(out.Stage((dir / "b.json").string(), "b").ok());
    CHECK_FALSE(fs::exists(dir / "a.json"));
  }
  CHECK(count_entries() == 0);
  {  // A failing device write fails the commit and lands nothing.
    OutputFiles out;
    REQUIRE(out.Stage((dir / "a.json").string(), "a").ok());
    REQUIRE(out.Stage("/dev/full", "x").ok());
    auto st = out.Commit();
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().code == ErrorCode::kRuntime);
    CHECK(st.error().message.starts_with("/dev/full: write failed"));
  }
  CHECK(count_entries() == 0);
  CHECK(fs::is_character_file("/dev/full"));
  // A symbolic link stays; its (dangling) target receives the bytes; an
  // existing file keeps its permission bits.
  fs::create_symlink(dir / "target.json", dir / "link.json");
  REQUIRE(WriteFileAtomic((dir / "link.json").string(), "one").ok());
  CHECK(fs::is_symlink(dir / "link.json"));
  fs::permissions(dir / "target.json", fs::perms(0640));
  REQUIRE(WriteFileAtomic((dir / "link.json").string(), "two").ok());
  CHECK(fs::is_symlink(dir / "link.json"));
  CHECK((fs::status(dir / "target.json").permissions() & fs::perms::all) == fs::perms(0640));
  std::ifstream in(dir / "target.json");
  std::string s;
  std::getline(in, s);
  CHECK(s == "two");
  // A link loop and a directory are refused.
  fs::create_symlink(dir / "loop2", dir / "loop1");
  fs::create_symlink(dir / "loop1", dir / "loop2");
  CHECK(WriteFileAtomic((dir / "loop1").string(), "x").error().message.find("too many levels") != std::string::npos);
  CHECK(WriteFileAtomic(dir.string(), "x").error().message.find("is a directory") != std::string::npos);
  CHECK_FALSE(OutputFiles::CheckWritable((dir / "no/such/x.json").string()).ok());
  CHECK(OutputFiles::CheckWritable("/dev/null").ok());
  // A staged directory replaces a previous dump, never other files.
  {
    OutputFiles out;
    auto staged = out.StageDirectory((dir / "dump").string());
    REQUIRE(staged.ok());
    fs::create_directories(fs::path(*staged) / "grads");
    std::ofstream(fs::path(*staged) / "grads" / "w.npy") << "x";
    REQUIRE(out.Commit().ok());
  }
  CHECK(fs::exists(dir / "dump" / "grads" / "w.npy"));
  {
    OutputFiles out;
    REQUIRE(out.StageDirectory((dir / "dump").string()).ok());
    REQUIRE(out.Commit().ok());
  }
  CHECK_FALSE(fs::exists(dir / "dump" / "grads"));
  std::ofstream(dir / "dump" / "notes.txt") << "mine";
  {
    OutputFiles out;
    CHECK_FALSE(out.StageDirectory((dir / "dump").string()).ok());
  }
  CHECK(fs::exists(dir / "dump" / "notes.txt"));
  fs::remove_all(dir);
}

TEST_CASE("a FIFO nobody writes is refused after MEMPLAN_INPUT_TIMEOUT_S; one that is written is read") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("memplan-fifo-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string fifo = (dir / "in.fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  ::setenv("MEMPLAN_INPUT_TIMEOUT_S", "0.2", 1);
  auto silent = memplan::ReadJsonFile(fifo);
  REQUIRE(!silent.ok());
  CHECK(silent.error().message == fifo + ": cannot read: no data for 0.2 s (a FIFO or device nobody writes? "
                                         "MEMPLAN_INPUT_TIMEOUT_S sets the wait)");
  // A writer that opens, writes and closes: read to its end.
  pid_t writer = ::fork();
  REQUIRE(writer >= 0);
  if (writer == 0) {
    FILE* f = std::fopen(fifo.c_str(), "w");
    if (f) std::fputs("{\"a\": [1, 2]}", f);
    std::_Exit(f && std::fclose(f) == 0 ? 0 : 1);
  }
  ::setenv("MEMPLAN_INPUT_TIMEOUT_S", "10", 1);
  auto written = memplan::ReadJsonFile(fifo);
  REQUIRE(written.ok());
  CHECK((*written)["a"].size() == 2);
  int status = 0;
  ::waitpid(writer, &status, 0);
  // A stream longer than the limit, valid as far as it goes: refused once
  // the limit is passed, with the limit's message (not "invalid JSON").
  writer = ::fork();
  REQUIRE(writer >= 0);
  if (writer == 0) {
    FILE* f = std::fopen(fifo.c_str(), "w");
    if (f) std::fputs("[1, 2, 3, 4, 5, 6, 7, 8]", f);
    std::_Exit(f && std::fclose(f) == 0 ? 0 : 1);
  }
  memplan::JsonLimits small;
  small.max_bytes = 10;
  auto longer = memplan::ReadJsonFile(fifo, small);
  REQUIRE(!longer.ok());
  CHECK(longer.error().message == fifo + ": /: input exceeds the limit of 10 bytes");
  ::unsetenv("MEMPLAN_INPUT_TIMEOUT_S");
  ::waitpid(writer, &status, 0);
  fs::remove_all(dir);
}

TEST_CASE("registered cleanup paths are removed whole; dropped ones are kept") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("memplan-cleanup-" + std::to_string(::getpid()));
  fs::create_directories(dir / "staged" / "weights");
  std::ofstream(dir / "staged" / "weights" / "w.npy") << "x";
  std::ofstream(dir / "staged" / "top.npy") << "y";
  std::ofstream(dir / "kept.json") << "{}";
  const int staged = memplan::AddCleanupPath((dir / "staged").string());
  const int kept = memplan::AddCleanupPath((dir / "kept.json").string());
  REQUIRE(staged >= 0);
  REQUIRE(kept >= 0);
  memplan::DropCleanupPath(kept);
  memplan::RemoveCleanupPaths();
  CHECK(!fs::exists(dir / "staged"));
  CHECK(fs::exists(dir / "kept.json"));
  fs::remove_all(dir);
}

TEST_CASE("ParallelFor: every index once, on any number of threads; the lowest failing index's exception") {
  for (int threads : {1, 2, 7}) {
    CAPTURE(threads);
    SetThreads(threads);
    CHECK(Threads() == threads);
    std::vector<std::atomic<int>> seen(100);
    ParallelFor(seen.size(), [&](size_t i) { seen[i].fetch_add(1); });
    int once = 0;
    for (const auto& s : seen) once += s.load() == 1 ? 1 : 0;
    CHECK(once == 100);
    std::atomic<int> ran{0};
    try {
      ParallelFor(20, [&](size_t i) {
        ran.fetch_add(1);
        if (i == 3 || i == 11) throw std::runtime_error("index " + std::to_string(i));
      });
      FAIL("ParallelFor swallowed an exception");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "index 3");
    }
    CHECK(ran.load() == 20);  // the others still ran
    ParallelFor(0, [&](size_t) { FAIL("called for an empty range"); });
    // Nested: the inner loop runs on the outer call's thread, every index once.
    std::vector<std::atomic<int>> inner(4 * 25);
    std::atomic<int> foreign{0};
    ParallelFor(4, [&](size_t o) {
      const auto me = std::this_thread::get_id();
      ParallelFor(25, [&](size_t i) {
        if (std::this_thread::get_id() != me) foreign.fetch_add(1);
        inner[o * 25 + i].fetch_add(1);
      });
    });
    CHECK(foreign.load() == 0);
    int nested_once = 0;
    for (const auto& s : inner) nested_once += s.load() == 1 ? 1 : 0;
    CHECK(nested_once == 100);
  }
  SetThreads(0);
  CHECK(Threads() >= 1);
}

// tests/test_main.cc calls KeepFreedHeapMemory() first, as memplan's main
// does (docs/design.md, "Process memory").
TEST_CASE("the heap's first GiB is advised for transparent huge pages, and heap blocks land there") {
  std::ifstream mode("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes((std::istreambuf_iterator<char>(mode)), std::istreambuf_iterator<char>());
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  const bool sanitized = true;
#else
  const bool sanitized = false;
#endif
  if (modes.empty() || modes.find("[never]") != std::string::npos || sanitized) {
    MESSAGE("no transparent huge pages here (or a sanitizer's allocator): nothing to check");
    CHECK(HugePageHeapRange().first == HugePageHeapRange().second);
    return;
  }
  const auto [begin, end] = HugePageHeapRange();
  REQUIRE(end > begin);
  CHECK(begin % static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE)) == 0);
  CHECK(end - begin >= (size_t{1} << 30));
  // A block of the heap (under the 32 MiB mmap threshold) lands in the range,
  // and the kernel reports the range's mapping as eligible for huge pages.
  std::vector<char> block(8 << 20, 1);
  const auto at = reinterpret_cast<uintptr_t>(block.data());
  CHECK(at >= begin);
  CHECK(at < end);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  int eligible = -1;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      eligible = std::atoi(line.c_str() + 12);
    }
  }
  CHECK(eligible == 1);
}
