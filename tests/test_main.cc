// doctest's main, plus one rule: a run that selects no test case fails. A
// Meson test that filters cases by name (-tc=...) would otherwise pass
// silently once the case it names is renamed. The heap is tuned as the
// memplan command tunes it (heap_tuning.h), so the tests time what users run.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "memplan/common/heap_tuning.h"

namespace {

int g_selected = -1;  // test cases that passed the filters; -1: no run

struct SelectionListener : doctest::IReporter {
  explicit SelectionListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    g_selected = static_cast<int>(stats.numTestCasesPassingFilters);
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_LISTENER("selection", 1, SelectionListener);

int main(int argc, char** argv) {
  memplan::KeepFreedHeapMemory();
  doctest::Context context(argc, argv);
  int result = context.run();
  if (context.shouldExit()) return result;  // --help, --list-test-cases...
  if (result == 0 && g_selected == 0) {
    std::fprintf(stderr, "test_main: no test case matched the filters\n");
    return 1;
  }
  return result;
}
