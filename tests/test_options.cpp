// The runtime-options table: every switch listed once in Id order, values checked by type,
// job-scope values per job, process-scope ones refused per job.
#include <QtTest>

#include <cstdlib>
#include <mutex>
#include <set>

#include "core/parallel/communicator.h"
#include "core/parallel/device_group.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "test_util.h"

using namespace diffract;
namespace opt = diffract::options;

class TestOptions : public QObject {
  Q_OBJECT

 private slots:
  void tableListsEachOptionOnceInIdOrder() {
    const auto& t = opt::table();
    QVERIFY(t.size() >= 23);
    std::set<std::string_view> names;
    for (std::size_t i = 0; i < t.size(); ++i) {
      QCOMPARE(static_cast<std::size_t>(t[i].id), i);
      QVERIFY(t[i].name.rfind("DIFFRACT_", 0) == 0);
      QVERIFY2(names.insert(t[i].name).second, std::string(t[i].name).c_str());
      QVERIFY(!t[i].doc.empty());
      // Every default is a valid value of its own option.
      QVERIFY2(opt::invalid_reason(t[i], t[i].default_value).empty(), std::string(t[i].name).c_str());
      QCOMPARE(opt::find(t[i].name), &t[i]);
    }
    QVERIFY(opt::find("DIFFRACT_NO_SUCH") == nullptr);
  }

  void valuesAreCheckedByType() {
    const auto& flag = opt::info(opt::Id::CudaGraphs);
    QVERIFY(opt::invalid_reason(flag, "0").empty());
    QVERIFY(opt::invalid_reason(flag, "1").empty());
    QCOMPARE(opt::invalid_reason(flag, "yes"), std::string("expected 0 or 1"));
    const auto& integer = opt::info(opt::Id::GroupNormStatsBlocks);
    QVERIFY(opt::invalid_reason(integer, "4").empty());
    QVERIFY(!opt::invalid_reason(integer, "0").empty());
    QVERIFY(!opt::invalid_reason(integer, "-3").empty());
    QVERIFY(!opt::invalid_reason(integer, "99999999999").empty());
    const auto& choice = opt::info(opt::Id::ParallelVae);
    QVERIFY(opt::invalid_reason(choice, "overlap").empty());
    QVERIFY(opt::invalid_reason(choice, "").empty());
    QVERIFY(opt::invalid_reason(choice, "sideways").find("overlap") != std::string::npos);
  }

  // A job-scope option: the environment's value, a job's own value inside its scope, the
  // environment's again after it; an invalid environment value falls back to the default.
  void jobScopeValuesApplyInsideTheirScope() {
    ::setenv("DIFFRACT_BATCH_VAE", "0", 1);
    QVERIFY(!opt::flag(opt::Id::BatchVae));
    {
      const opt::Overrides mine = {{"DIFFRACT_BATCH_VAE", "1"}};
      const opt::JobOptionsScope scope(mine);
      QVERIFY(opt::flag(opt::Id::BatchVae));
      QVERIFY(opt::is_set(opt::Id::BatchVae));
    }
    QVERIFY(!opt::flag(opt::Id::BatchVae));
    ::setenv("DIFFRACT_BATCH_VAE", "maybe", 1);
    QVERIFY(opt::flag(opt::Id::BatchVae));  // the default, with a warning
    QVERIFY(!opt::is_set(opt::Id::BatchVae));
    ::unsetenv("DIFFRACT_BATCH_VAE");
    QCOMPARE(opt::value(opt::Id::ParallelVae), std::string());
  }

  // A strategy's ranks run on threads of their own (rank 0 on the caller's): each sees the job's values.
  void jobOptionsReachEveryRank() {
    const auto group = parallel::DeviceGroup::virtual_cpu(3);
    std::mutex mutex;
    std::vector<std::string> seen(3);
    const opt::Overrides mine = {{"DIFFRACT_BATCH_VAE", "1"}};
    {
      const opt::JobOptionsScope scope(mine);
      group->run([&](int rank, parallel::Communicator&) {
        std::lock_guard lock(mutex);
        seen[static_cast<std::size_t>(rank)] = opt::value(opt::Id::BatchVae);
      });
    }
    QCOMPARE(seen, (std::vector<std::string>{"1", "1", "1"}));
    group->run([&](int rank, parallel::Communicator&) {
      std::lock_guard lock(mutex);
      seen[static_cast<std::size_t>(rank)] = opt::is_set(opt::Id::BatchVae) ? "set" : "unset";
    });
    if (!std::getenv("DIFFRACT_BATCH_VAE")) QCOMPARE(seen, (std::vector<std::string>{"unset", "unset", "unset"}));
  }

  void overridesNameJobScopeOptionsWithValidValues() {
    opt::check_overrides({{"DIFFRACT_DRIFFUSION_PAIRS", "0"}, {"DIFFRACT_PARALLEL_VAE", "exchange"}});
    DIFFRACT_EXPECT_ERROR(opt::check_overrides({{"DIFFRACT_GEMM_TUNING", "0"}}), "DIFFRACT_GEMM_TUNING",
                          "read once per process", "DIFFRACT_DRIFFUSION_PAIRS");
    DIFFRACT_EXPECT_ERROR(opt::check_overrides({{"DIFFRACT_WARP", "1"}}), "unknown option DIFFRACT_WARP");
    DIFFRACT_EXPECT_ERROR(opt::check_overrides({{"DIFFRACT_PARALLEL_VAE", "sideways"}}), "DIFFRACT_PARALLEL_VAE=sideways",
                          "expected one of");
  }

  // A job's scope holds job-scope values only: a process-scope one there is not taken.
  void processScopeOptionsComeFromTheEnvironment() {
    ::setenv("DIFFRACT_FUSED_TAESD", "0", 1);
    {
      const opt::Overrides mine = {{"DIFFRACT_FUSED_TAESD", "1"}};
      const opt::JobOptionsScope scope(mine);
      QVERIFY(!opt::flag(opt::Id::FusedTaesd));
    }
    ::unsetenv("DIFFRACT_FUSED_TAESD");
    QVERIFY(opt::flag(opt::Id::FusedTaesd));
  }
};

QTEST_APPLESS_MAIN(TestOptions)
#include "test_options.moc"
