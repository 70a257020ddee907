// The LibTorch test binary's entry point: one intra-op thread, as every rank
// of a 2-core job gets, and no thread pool for forked ranks to inherit.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/doctest.hpp"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <cstdio>

namespace {

// The test process itself; ranks that accel::spawn forks have other pids.
const pid_t test_process = ::getpid();

// A doctest CHECK that fails inside a forked rank would be recorded in that
// rank's copy of doctest's state and lost when the rank exits 0. This
// listener makes it fail the rank instead: the rank prints the assertion and
// exits 1, so accel::spawn, and with it the test, fails.
struct RankAssertionListener : doctest::IReporter {
  explicit RankAssertionListener(const doctest::ContextOptions&) {}
  void log_assert(const doctest::AssertData& data) override {
    if (!data.m_failed || ::getpid() == test_process) return;
    std::fprintf(stderr, "%s:%d: a check failed in rank pid %d: %s (%s)\n", data.m_file, data.m_line,
                 static_cast<int>(::getpid()), data.m_expr, data.m_decomp.c_str());
    std::fflush(stderr);
    ::_exit(1);  // as accel::spawn's ranks exit: not exit(), the test runner's atexit handlers must not run
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("rank_assertions", 1, RankAssertionListener);

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  doctest::Context context(argc, argv);
  return context.run();
}
