// Device discovery and the mapping of enabled GPUs and a strategy to a request's device(s).
#include <QtTest>

#include "core/engine/devices.h"
#include "core/parallel/strategies.h"
#include "core/util/error.h"
#include "core/util/build_info.h"

using namespace diffract;
using engine::choose_devices;

class TestDevices : public QObject {
  Q_OBJECT

 private slots:
  void listsOneEntryPerCudaDevice() {
    const auto devices = engine::list_devices();
    QCOMPARE(static_cast<int>(devices.size()), build_info().cuda_devices);
    for (std::size_t i = 0; i < devices.size(); ++i) {
      QCOMPARE(devices[i].index, static_cast<int>(i));
      QVERIFY(!devices[i].name.empty());
      QVERIFY(devices[i].total_bytes > 0);
      QVERIFY(devices[i].used_bytes <= devices[i].total_bytes);
    }
  }

  void noGpuRunsOnTheCpuWithVirtualDevices() {
    auto c = choose_devices({}, "single", 1);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cpu"));
    QCOMPARE(c.devices, 1);
    c = choose_devices({}, "driffusion", 3);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cpu"));
    QCOMPARE(c.devices, 3);
    c = choose_devices({}, "cfg-parallel", 2);  // two virtual devices on the CPU are fine
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cpu"));
    c = choose_devices({}, "", 0);
    QVERIFY(c.error.empty());
    QCOMPARE(c.devices, 1);
  }

  // choose_devices keeps its own list of strategy names; every one the registry offers (the list
  // its unknown-name error gives) must be in it, or the GUI and CLI refuse a strategy that exists.
  void knowsEveryRegisteredStrategy() {
    std::string offered;
    try {
      parallel::make_strategy("no-such-strategy", 2, 0);
      QFAIL("make_strategy accepted an unknown name");
    } catch (const Error& e) {
      const std::string what = e.what();
      const auto open = what.rfind('('), close = what.rfind(')');
      QVERIFY(open != std::string::npos && close > open);
      offered = what.substr(open + 1, close - open - 1);
    }
    int names = 0;
    for (std::size_t pos = 0; pos < offered.size();) {
      const auto end = std::min(offered.find(',', pos), offered.size());
      auto name = offered.substr(pos, end - pos);
      name.erase(0, name.find_first_not_of(' '));
      pos = end + 1;
      ++names;
      const auto c = choose_devices({}, name, 4);
      QVERIFY2(c.error.empty(), (name + ": " + c.error).c_str());
    }
    QVERIFY(names >= 13);
  }

  void singleRunsOnTheLowestEnabledGpu() {
    const auto c = choose_devices({3, 1}, "single", 5);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:1"));
    QCOMPARE(c.devices, 1);
  }

  void multiGpuStrategiesCountTheEnabledGpus() {
    auto c = choose_devices({0, 1}, "cfg-parallel", 1);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:0"));
    QCOMPARE(c.devices, 2);
    c = choose_devices({2, 3, 1}, "driffusion-aggressive", 1);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:1"));
    QCOMPARE(c.devices, 3);
    c = choose_devices({4, 5, 6, 7}, "data-parallel", 1);
    QCOMPARE(c.device, std::string("cuda:4"));
    QCOMPARE(c.devices, 4);
    c = choose_devices({0, 1, 2}, "hybrid-cfg", 1);  // takes the first two
    QVERIFY(c.error.empty());
    QCOMPARE(c.devices, 2);
    c = choose_devices({2, 3}, "pipefusion", 1);  // one stage per enabled GPU
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:2"));
    QCOMPARE(c.devices, 2);
    c = choose_devices({0, 1, 2, 3, 4}, "cfg-driffusion", 1);  // pairs of GPUs: the first four
    QVERIFY(c.error.empty());
    QCOMPARE(c.devices, 4);
    c = choose_devices({3}, "cfg-driffusion-aggressive", 1);
    QVERIFY(!c.error.empty());
    c = choose_devices({1, 2, 3}, "asyncdiff", 1);  // one UNet component per enabled GPU
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:1"));
    QCOMPARE(c.devices, 3);
    c = choose_devices({1, 2, 3}, "asyncdiff-stride2", 1);  // 2 components, the last on 2 GPUs
    QVERIFY(c.error.empty());
    QCOMPARE(c.devices, 3);
    c = choose_devices({0, 1}, "asyncdiff-stride2", 1);
    QVERIFY2(c.error.find("needs 3 GPUs") != std::string::npos, c.error.c_str());
    c = choose_devices({}, "asyncdiff-stride2", 3);  // CPU virtual devices
    QVERIFY(c.error.empty());
    QCOMPARE(c.devices, 3);
  }

  void stepSkipKeepsItsSkipFactor() {
    const auto c = choose_devices({0, 1}, "step-skip", 4);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:0"));
    QCOMPARE(c.devices, 4);
  }

  void errorsAreReadable() {
    auto c = choose_devices({0}, "cfg-parallel", 2);
    QCOMPARE(c.error, std::string("strategy cfg-parallel needs 2 GPUs; 1 is enabled (enable another GPU, or choose single)"));
    c = choose_devices({1}, "hybrid-cfg", 1);
    QVERIFY(c.error.find("needs 2 GPUs") != std::string::npos);
    c = choose_devices({0, 2}, "driffusion", 1);
    QVERIFY2(c.error.find("consecutive GPUs") != std::string::npos && c.error.find("cuda:1 is not enabled") != std::string::npos,
             c.error.c_str());
    c = choose_devices({0}, "warp-drive", 1);
    QCOMPARE(c.error, std::string("unknown strategy 'warp-drive'"));
  }
};

QTEST_APPLESS_MAIN(TestDevices)
#include "test_devices.moc"
