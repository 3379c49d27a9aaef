// The tuning store (io/tuning_store.h): choices kept per GPU identity across processes; a
// damaged, foreign or unwritable file never throws and never hands back a record it did not
// check. And the sizes an engine prepares ahead of the first job (job/sizes.h).
#include <QtTest>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/io/tuning_store.h"
#include "core/job/sizes.h"

using namespace diffract;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

io::TuningIdentity h200() {
  io::TuningIdentity id;
  id.label = "NVIDIA H200";
  id.fields = {{"gpu", "NVIDIA H200"}, {"capability", "9.0"}, {"driver", "580.159.04"}, {"cublaslt", "130100"}};
  return id;
}

std::string read(const fs::path& p) {
  std::ifstream f(p);
  return {std::istreambuf_iterator<char>(f), {}};
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

}  // namespace

class TestTuningStore : public QObject {
  Q_OBJECT

  QTemporaryDir m_dir;
  fs::path file(const std::string& name) { return fs::path(m_dir.path().toStdString()) / name; }

 private slots:
  void recordsSurviveAProcess() {
    const auto f = file("round-trip.json");
    {
      io::TuningStore s(f, h200());
      QVERIFY(s.load_problem().empty());
      QVERIFY(!s.find("gemm", "1024x1280x1280").has_value());
      s.put("gemm", "1024x1280x1280", {{"cublaslt", true}, {"best_ms", 0.0123}});
      s.put("conv", "2x320x128x128", {{"plan", "heuristic"}});
      QVERIFY(s.dirty());
      QVERIFY(s.save());
      QVERIFY(!s.dirty());
    }
    io::TuningStore again(f, h200());
    QVERIFY2(again.load_problem().empty(), again.load_problem().c_str());
    const auto r = again.find("gemm", "1024x1280x1280");
    QVERIFY(r.has_value());
    QCOMPARE((*r)["best_ms"].get<double>(), 0.0123);
    QCOMPARE(again.size("conv"), std::size_t(1));
    QCOMPARE(again.size("fp8"), std::size_t(0));
    // Nothing changed: save() writes nothing (the file keeps its time).
    const auto written = fs::last_write_time(f);
    QVERIFY(again.save());
    QCOMPARE(fs::last_write_time(f), written);
  }

  // Another GPU, driver or library: the file's choices are not this process's to use.
  void anotherIdentityIsNotUsed() {
    const auto f = file("identity.json");
    {
      io::TuningStore s(f, h200());
      s.put("gemm", "k", {{"cublaslt", false}});
      QVERIFY(s.save());
    }
    auto other = h200();
    other.fields["driver"] = "590.10";
    io::TuningStore s(f, other);
    QVERIFY(!s.find("gemm", "k").has_value());
    QVERIFY2(s.load_problem().find("driver") != std::string::npos, s.load_problem().c_str());
    QVERIFY2(s.load_problem().find("590.10") != std::string::npos, s.load_problem().c_str());
    // Its own choices replace the foreign file on save.
    s.put("gemm", "mine", {{"cublaslt", false}});
    QVERIFY(s.save());
    io::TuningStore back(f, other);
    QVERIFY(back.load_problem().empty());
    QVERIFY(back.find("gemm", "mine").has_value());
    QVERIFY(!back.find("gemm", "k").has_value());
    // Two identities never share a file name.
    QVERIFY(io::tuning_file("/d", h200()) != io::tuning_file("/d", other));
  }

  // Each damaged file: no throw, no record, the reason named; the next save replaces it.
  void damagedFilesAreNamedNotThrown_data() {
    QTest::addColumn<QString>("text");
    QTest::addColumn<QString>("problem");
    QTest::newRow("empty") << "" << "malformed JSON";
    QTest::newRow("syntax") << "{\"format\": \"diffract-tuning\", " << "malformed JSON";
    QTest::newRow("not an object") << "[1, 2]" << "not a Diffract tuning store";
    QTest::newRow("other format") << R"({"format": "something"})" << "not a Diffract tuning store";
    QTest::newRow("version") << R"({"format": "diffract-tuning", "version": 99})" << "format version 99";
    QTest::newRow("version type") << R"({"format": "diffract-tuning", "version": "1"})" << "format version \"1\"";
    QTest::newRow("no identity") << R"({"format": "diffract-tuning", "version": 1})" << "no \"identity\"";
    QTest::newRow("identity value type")
        << R"({"format": "diffract-tuning", "version": 1, "identity": {"gpu": 7}, "tables": {}})" << "another";
    QTest::newRow("no tables")
        << R"({"format": "diffract-tuning", "version": 1, "identity": {"gpu": "NVIDIA H200", "capability": "9.0",
              "driver": "580.159.04", "cublaslt": "130100"}})"
        << "no \"tables\"";
    QTest::newRow("nested deep") << QString(200, '[') + QString(200, ']') << "nested deeper";
    QTest::newRow("duplicate key") << R"({"format": "diffract-tuning", "format": "diffract-tuning"})" << "twice";
    QTest::newRow("number out of range") << R"({"format": "diffract-tuning", "version": 1e400})" << "malformed JSON";
    QTest::newRow("binary") << QString::fromLatin1("\x89PNG\r\n\x1a\n\0\0", 10) << "malformed JSON";
  }
  void damagedFilesAreNamedNotThrown() {
    QFETCH(QString, text);
    QFETCH(QString, problem);
    const auto f = file("damaged.json");
    write(f, text.toStdString());
    io::TuningStore s(f, h200());
    QVERIFY2(s.load_problem().find(problem.toStdString()) != std::string::npos, s.load_problem().c_str());
    QCOMPARE(s.size("gemm"), std::size_t(0));
    s.put("gemm", "k", {{"cublaslt", false}});
    QVERIFY(s.save());
    io::TuningStore again(f, h200());
    QVERIFY2(again.load_problem().empty(), again.load_problem().c_str());
    QVERIFY(again.find("gemm", "k").has_value());
  }

  // Entries of the wrong kind are left out one by one; the rest of the file is used.
  void malformedEntriesAreLeftOut() {
    const auto f = file("entries.json");
    json id = json::object();
    for (const auto& [k, v] : h200().fields) id[k] = v;
    const json doc = {{"format", "diffract-tuning"},
                      {"version", 1},
                      {"identity", id},
                      {"tables", {{"gemm", {{"good", {{"cublaslt", false}}}, {"bad", 3}, {"worse", json::array()}}},
                                  {"conv", "not a table"}}}};
    write(f, doc.dump());
    io::TuningStore s(f, h200());
    QVERIFY(s.find("gemm", "good").has_value());
    QVERIFY(!s.find("gemm", "bad").has_value());
    QVERIFY(!s.find("gemm", "worse").has_value());
    QCOMPARE(s.size("conv"), std::size_t(0));
    QVERIFY2(s.load_problem().find("3 malformed entries") != std::string::npos, s.load_problem().c_str());
  }

  // Two processes tuning different shapes on the same GPU: the later save keeps the earlier's.
  void saveKeepsWhatAnotherProcessSaved() {
    const auto f = file("merge.json");
    io::TuningStore a(f, h200()), b(f, h200());
    a.put("gemm", "a-shape", {{"cublaslt", true}});
    b.put("gemm", "b-shape", {{"cublaslt", false}});
    b.put("gemm", "both", {{"from", "b"}});
    a.put("gemm", "both", {{"from", "a"}});
    QVERIFY(a.save());
    QVERIFY(b.save());
    io::TuningStore c(f, h200());
    QVERIFY(c.find("gemm", "a-shape").has_value());
    QVERIFY(c.find("gemm", "b-shape").has_value());
    QCOMPARE((*c.find("gemm", "both"))["from"].get<std::string>(), std::string("b"));
  }

  // Where the file cannot go: save() says so and the records stay in memory.
  void unwritableFolderIsAnErrorNotAThrow() {
    const auto blocker = file("a-file");
    write(blocker, "x");
    io::TuningStore s(blocker / "sub" / "store.json", h200());
    s.put("gemm", "k", {{"cublaslt", false}});
    QVERIFY(!s.save());
    QVERIFY(!s.last_error().empty());
    QVERIFY(s.find("gemm", "k").has_value());
    QVERIFY(s.dirty());
    // A store without a file keeps its records in memory only.
    io::TuningStore memory({}, h200());
    memory.put("gemm", "k", {{"cublaslt", false}});
    QVERIFY(memory.save());
    QVERIFY(memory.find("gemm", "k").has_value());
  }

  void fileNamesAreSafe() {
    auto id = h200();
    id.label = "../../etc/passwd NVIDIA\n(H200)";
    const auto f = io::tuning_file("/cache", id);
    QCOMPARE(f.parent_path(), fs::path("/cache"));
    const auto name = f.filename().string();
    QVERIFY2(name.rfind("tuning-", 0) == 0, name.c_str());
    QVERIFY2(name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-.") == std::string::npos, name.c_str());
    id.label = "";
    QVERIFY(io::tuning_file("/cache", id).filename().string().rfind("tuning-gpu-", 0) == 0);
  }

  void directoryFollowsTheEnvironment() {
    ::unsetenv("DIFFRACT_TUNING_STORE");
    ::setenv("DIFFRACT_TUNING_DIR", "/somewhere/tuning", 1);
    QCOMPARE(io::tuning_directory(), fs::path("/somewhere/tuning"));
    ::unsetenv("DIFFRACT_TUNING_DIR");
    ::setenv("XDG_CACHE_HOME", "/xdg-cache", 1);
    QCOMPARE(io::tuning_directory(), fs::path("/xdg-cache/diffract/tuning"));
    ::unsetenv("XDG_CACHE_HOME");
    ::setenv("HOME", "/home/designer", 1);
    QCOMPARE(io::tuning_directory(), fs::path("/home/designer/.cache/diffract/tuning"));
    ::setenv("DIFFRACT_TUNING_STORE", "0", 1);
    QVERIFY(io::tuning_directory().empty());
    ::unsetenv("DIFFRACT_TUNING_STORE");
  }

  // SDXL's buckets and the 4:3 / 16:9 sizes near a megapixel; SD 1.5's near 512²; never the
  // native size itself (the warm-up's) or sizes far from the model's pixel count.
  void sizesWorthPreparing() {
    const auto sdxl = job::sizes_to_tune(1024);
    const auto has = [](const std::vector<job::Size>& v, int w, int h) {
      return std::find(v.begin(), v.end(), job::Size{w, h}) != v.end();
    };
    QVERIFY(has(sdxl, 1152, 896));
    QVERIFY(has(sdxl, 896, 1152));
    QVERIFY(has(sdxl, 1344, 768));
    QVERIFY(has(sdxl, 1536, 640));
    QVERIFY(has(sdxl, 768, 768));
    QVERIFY(!has(sdxl, 1024, 1024));
    QVERIFY(!has(sdxl, 512, 512));
    QVERIFY(!has(sdxl, 768, 432));
    for (std::size_t i = 1; i < sdxl.size(); ++i)
      QVERIFY(sdxl[i - 1].width * sdxl[i - 1].height >= sdxl[i].width * sdxl[i].height);
    const auto sd15 = job::sizes_to_tune(512);
    QVERIFY(has(sd15, 640, 480));
    QVERIFY(!has(sd15, 512, 512));
    QVERIFY(!has(sd15, 1024, 1024));
    QVERIFY(job::sizes_to_tune(0).empty());
    // Every offered size but the first is a real size the GUI can set.
    const auto& all = job::size_presets();
    QCOMPARE(all.front().width, 0);
    for (std::size_t i = 1; i < all.size(); ++i) QVERIFY(all[i].width % 8 == 0 && all[i].height % 8 == 0);
  }
};

QTEST_APPLESS_MAIN(TestTuningStore)
#include "test_tuning_store.moc"
