// Device discovery and the mapping of enabled GPUs and a strategy to a request's device(s).
#include <QtTest>

#include "core/engine/devices.h"
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
