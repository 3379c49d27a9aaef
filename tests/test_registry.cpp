// The strategy registry: one entry per strategy, each making the strategy it names on the
// devices its rule allows, refusing the families it cannot run with its reason.
#include <QtTest>

#include <set>

#include "core/parallel/strategies.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::parallel;

class TestRegistry : public QObject {
  Q_OBJECT

 private slots:
  void everyEntryMakesTheStrategyItNames() {
    std::set<std::string_view> names;
    QCOMPARE(strategies().front().name, std::string_view("single"));
    for (const auto& s : strategies()) {
      QVERIFY2(names.insert(s.name).second, std::string(s.name).c_str());
      QVERIFY(!s.hint.empty());
      QVERIFY(s.unet || s.transformer);
      QVERIFY(s.unet && s.transformer ? s.refused_why.empty() : !s.refused_why.empty());
      QCOMPARE(find_strategy(s.name), &s);
      job::StrategyParams p;
      p.name = std::string(s.name);
      p.devices = s.devices.fixed > 0 ? s.devices.fixed : std::max(s.devices.min, 4);
      const auto made = make_strategy(p);
      QCOMPARE(made->name(), std::string(s.name));
      QCOMPARE(made->devices(), p.devices);
      QVERIFY(s.devices.allows(made->devices()));
    }
    QCOMPARE(find_strategy(""), &strategies().front());
    QVERIFY(find_strategy("warp-drive") == nullptr);
    QCOMPARE(find_strategy("asyncdiff-stride3")->name, std::string_view("asyncdiff-stride2"));
    QCOMPARE(make_strategy("asyncdiff-stride3", 4)->name(), std::string("asyncdiff-stride3"));
  }

  void typedParametersReachTheStrategy() {
    job::StrategyParams p;
    p.name = "step-skip";
    p.skip = 3;
    p.devices = 1;
    QCOMPARE(dynamic_cast<const StepSkipping&>(*make_strategy(p)).skip, 3);
    p.skip = 0;
    DIFFRACT_EXPECT_ERROR(make_strategy(p), "skip of 1 or more");
    p = {};
    p.name = "pipefusion";
    p.devices = 2;
    p.patches = 4;
    QCOMPARE(dynamic_cast<const PipeFusion&>(*make_strategy(p)).patch_count(), 4);
    p.devices = 65;
    DIFFRACT_EXPECT_ERROR(make_strategy(p), "devices 65 must be 64 or fewer");
    p.devices = 0;
    DIFFRACT_EXPECT_ERROR(make_strategy(p)->validate(1, true), "needs 1 or more devices");
    QCOMPARE(dynamic_cast<const DRiffusion&>(*make_strategy("cfg-driffusion", 4)).n, 2);
  }

  void familiesAndGuidanceAreCheckedWithReasons() {
    job::StrategyParams p;
    p.name = "pipefusion";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SDXL, true), "pipefusion does not run sdxl", "runs SD3 and Flux");
    check_strategy(p, job::ModelFamily::SD3, true);
    p.name = "hybrid-cfg";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SD3, true), "hybrid-cfg", "SD3's MMDiT has none");
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SD1, false), "needs classifier-free guidance");
    check_strategy(p, job::ModelFamily::SD2, true);
    p.name = "asyncdiff";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SD3, true), "asyncdiff does not run sd3");
    // The transformer strategies run both transformer families.
    p.name = "sequence-parallel";
    check_strategy(p, job::ModelFamily::Flux, false);
    check_strategy(p, job::ModelFamily::SD3, true);
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SDXL, true), "sequence-parallel does not run sdxl", "UNet");
    p.name = "pipefusion";
    check_strategy(p, job::ModelFamily::Flux, false);
    p.name = "warp-drive";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SD1, true), "unknown strategy 'warp-drive'", "cfg-parallel",
                          "distrifusion");
  }

  void deviceRulesDescribeThemselves() {
    QCOMPARE(strategy_info("cfg-parallel").devices.describe(), std::string("2 devices"));
    QCOMPARE(strategy_info("cfg-driffusion").devices.describe(), std::string("an even number of devices, 2 or more"));
    QCOMPARE(strategy_info("driffusion").devices.most_of(5), 5);
    QCOMPARE(strategy_info("cfg-driffusion").devices.most_of(5), 4);
    QCOMPARE(strategy_info("asyncdiff-stride2").devices.most_of(2), 0);
    QCOMPARE(strategy_info("single").devices.most_of(3), 1);
  }
};

QTEST_APPLESS_MAIN(TestRegistry)
#include "test_registry.moc"
