// main() for the GPU tests: like gtest_main, but exits 77 (meson's SKIP) when
// every test that ran was skipped, so a machine without a GPU reports the suite
// as skipped rather than passed. The skip reasons are printed by GTEST_SKIP.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  if (rc == 0 && u.test_to_run_count() > 0 && u.skipped_test_count() == u.test_to_run_count())
    return 77;
  return rc;
}
