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

  // Every strategy the registry lists can be chosen on CPU virtual devices.
  void knowsEveryRegisteredStrategy() {
    QVERIFY(parallel::strategies().size() >= 14);
    for (const auto& s : parallel::strategies()) {
      const auto c = choose_devices({}, std::string(s.name), 4);
      QVERIFY2(c.error.empty(), (std::string(s.name) + ": " + c.error).c_str());
      QVERIFY(s.devices.allows(c.devices));
    }
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
    QVERIFY2(c.error.find("needs 3 or more devices") != std::string::npos, c.error.c_str());
    c = choose_devices({}, "asyncdiff-stride2", 3);  // CPU virtual devices
    QVERIFY(c.error.empty());
    QCOMPARE(c.devices, 3);
  }

  void stepSkipRunsOnOneDeviceWithItsSkipFactor() {
    const auto c = choose_devices({0, 1}, "step-skip", 4);
    QVERIFY(c.error.empty());
    QCOMPARE(c.device, std::string("cuda:0"));
    QCOMPARE(c.devices, 1);
    QCOMPARE(c.skip, 4);
    QCOMPARE(c.gpus, std::vector<int>{0});
  }

  // The GPUs are the enabled ones in index order, consecutive or not; a count asked for takes
  // the first that many.
  void gpusAreTheEnabledOnesInOrder() {
    auto c = choose_devices({2, 0}, "driffusion", 1);
    QVERIFY2(c.error.empty(), c.error.c_str());
    QCOMPARE(c.device, std::string("cuda:0"));
    QCOMPARE(c.gpus, (std::vector<int>{0, 2}));
    c = choose_devices({0, 1, 2, 3}, "driffusion", 1, 3);
    QCOMPARE(c.devices, 3);
    QCOMPARE(c.gpus, (std::vector<int>{0, 1, 2}));
    c = choose_devices({0, 1, 2, 3}, "cfg-driffusion", 1, 3);
    QVERIFY2(c.error.find("an even number of devices") != std::string::npos, c.error.c_str());
    c = choose_devices({0, 1}, "data-parallel", 1, 3);
    QVERIFY2(c.error.find("3 asked for") != std::string::npos, c.error.c_str());
  }

  void errorsAreReadable() {
    auto c = choose_devices({0}, "cfg-parallel", 2);
    QCOMPARE(c.error,
             std::string("strategy cfg-parallel needs 2 devices; 1 GPU is enabled (enable another GPU, or choose single)"));
    c = choose_devices({1}, "hybrid-cfg", 1);
    QVERIFY(c.error.find("needs 2 devices") != std::string::npos);
    c = choose_devices({0}, "warp-drive", 1);
    QCOMPARE(c.error, std::string("unknown strategy 'warp-drive'"));
  }
};

QTEST_APPLESS_MAIN(TestDevices)
#include "test_devices.moc"
