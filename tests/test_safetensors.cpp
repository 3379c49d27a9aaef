#include <sys/stat.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/io/weights.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

// Writes a safetensors file from a raw header string and `data_bytes` zero bytes.
fs::path write_raw(const fs::path& dir, const std::string& name, const std::string& header, std::size_t data_bytes,
                   std::int64_t declared_len = -1) {
  const auto path = dir / name;
  std::ofstream out(path, std::ios::binary);
  std::uint64_t len = declared_len < 0 ? header.size() : static_cast<std::uint64_t>(declared_len);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header;
  out << std::string(data_bytes, '\0');
  return path;
}

}  // namespace

class TestSafetensors : public QObject {
  Q_OBJECT
 private slots:
  void readsEveryDtypeWithPythonValues() {
    auto archive = io::SafetensorsArchive::open(test::fixtures() / "dtypes.safetensors");
    std::ifstream in(test::fixtures() / "dtypes.json");
    const auto expected = nlohmann::json::parse(in);
    QCOMPARE(expected.size(), std::size_t(14));  // make_dtypes: 12 dtypes, a scalar, an empty tensor
    QCOMPARE(archive->tensors().size(), expected.size());
    std::shared_ptr<const io::SafetensorsArchive> shared = archive;
    for (const auto& [name, e] : expected.items()) {
      const auto& info = archive->at(name);
      QCOMPARE(info.shape, e["shape"].get<std::vector<std::int64_t>>());
      auto t = io::to_tensor(shared, info);
      if (t.numel() > 0)
        QVERIFY2(t.data_ptr() == static_cast<const void*>(info.data), (name + ": must view the mapping, not a copy").c_str());
      auto values = e["values"].get<std::vector<double>>();
      auto got = t.to(at::kDouble).flatten();
      QCOMPARE(got.numel(), static_cast<std::int64_t>(values.size()));
      for (std::size_t i = 0; i < values.size(); ++i)
        QVERIFY2(got[static_cast<std::int64_t>(i)].item<double>() == values[i], name.c_str());
    }
    QCOMPARE(archive->metadata().at("made_by"), std::string("oracle"));
    QCOMPARE(io::dtype_name(archive->at("f8_e4m3").dtype), std::string_view("F8_E4M3"));
  }

  void tensorsOutliveTheArchiveHandle() {
    at::Tensor t;
    {
      auto state = io::load_state_dict(test::fixtures() / "dtypes.safetensors");
      t = state.at("f32");
    }
    QCOMPARE(t[1][2].item<float>(), 100.0f);
  }

  void readsShardedCheckpoints() {
    const auto dir = test::fixtures() / "sharded";
    auto archive = io::SafetensorsArchive::open(dir / "model.safetensors.index.json");
    QCOMPARE(archive->tensors().size(), std::size_t(5));
    QCOMPARE(archive->file_of("layer.4.weight").filename().string(), std::string("model-00002-of-00002.safetensors"));
    auto got = io::load_state_dict(dir / "model.safetensors.index.json");
    auto expected = io::load_state_dict(dir / "expected.safetensors");
    QCOMPARE(got.size(), expected.size());
    for (const auto& [k, v] : expected) QVERIFY(at::equal(got.at(k), v));
  }

  void rejectsTruncatedFile() {
    QTemporaryDir tmp;
    const auto p = fs::path(tmp.path().toStdString()) / "short.safetensors";
    std::ofstream(p, std::ios::binary) << "abc";
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "short.safetensors", "truncated");
  }

  void rejectsHeaderLengthPastEnd() {
    QTemporaryDir tmp;
    auto p = write_raw(tmp.path().toStdString(), "long.safetensors", "{}", 0, 5000);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "long.safetensors", "header length 5000 runs past the end");
  }

  void rejectsMalformedJson() {
    QTemporaryDir tmp;
    auto p = write_raw(tmp.path().toStdString(), "bad.safetensors", R"({"a": {"dtype": "F32", )", 0);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "bad.safetensors", "header: malformed JSON");
  }

  void rejectsUnknownDtype() {
    QTemporaryDir tmp;
    auto p = write_raw(tmp.path().toStdString(), "dt.safetensors",
                       R"({"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}})", 8);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "dt.safetensors", "tensor 'w'", "unknown dtype \"F7\"");
  }

  void rejectsDtypeShapeMismatch() {
    QTemporaryDir tmp;
    auto p = write_raw(tmp.path().toStdString(), "mm.safetensors",
                       R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", 12);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "tensor 'w'", "needs 16 bytes but data_offsets span 12");
  }

  void rejectsOffsetsOutsideData() {
    QTemporaryDir tmp;
    auto p = write_raw(tmp.path().toStdString(), "oob.safetensors",
                       R"({"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}})", 16);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "oob.safetensors", "tensor 'w'", "outside the data area");
    auto q = write_raw(tmp.path().toStdString(), "rev.safetensors",
                       R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 16);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(q), "tensor 'w'", "end before they begin");
  }

  void rejectsOverlappingTensors() {
    QTemporaryDir tmp;
    auto p = write_raw(tmp.path().toStdString(), "ov.safetensors",
                       R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                       12);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "ov.safetensors", "'a' and 'b' overlap");
  }

  // Hostile headers: errors naming the file, never a crash, a hang or a silently wrong archive.
  void rejectsHostileHeaders() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    // Nested 100 000 levels deep where a shape belongs: refused at parse time (dump() or a copy of
    // such a value would recurse past the stack's end).
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    auto p = write_raw(dir, "deep.safetensors", R"({"w": {"dtype": "F32", "shape": )" + deep + R"(, "data_offsets": [0, 0]}})", 0);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "deep.safetensors", "nested deeper than 8 levels");
    p = write_raw(dir, "deepoff.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": )" + deep + "}}", 4);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "deepoff.safetensors", "nested deeper");
    // 2^62 F32 with no bytes: numel x 4 overflows to 0 without the check.
    p = write_raw(dir, "ovf.safetensors", R"({"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", 0);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "ovf.safetensors", "tensor 'w'", "too large");
    // A dimension above 2^63 would turn negative in an int64 shape.
    p = write_raw(dir, "neg.safetensors", R"({"w": {"dtype": "U8", "shape": [9223372036854775808, 0], "data_offsets": [0, 0]}})", 0);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "neg.safetensors", "tensor 'w'", "too large");
    p = write_raw(dir, "rank.safetensors", R"({"w": {"dtype": "U8", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1], "data_offsets": [0, 1]}})", 1);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "rank.safetensors", "17 dimensions");
    // Bytes after the last tensor, or between two: the format forbids both.
    p = write_raw(dir, "tail.safetensors", R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", 6);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "tail.safetensors", "4 bytes after the last tensor");
    p = write_raw(dir, "hole.safetensors", R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                                                "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}})", 6);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "hole.safetensors", "2 bytes before tensor 'b'");
    // The same name twice: nlohmann would keep the last silently.
    p = write_raw(dir, "dup.safetensors", R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                               "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})", 2);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "dup.safetensors", "\"w\" appears twice");
    // A number beyond double's range, a dtype of 100 000 characters: named, not echoed whole.
    p = write_raw(dir, "big.safetensors", R"({"w": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}})", 4);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(p), "big.safetensors", "malformed JSON", "1e400");
    p = write_raw(dir, "dt.safetensors", R"({"w": {"dtype": ")" + std::string(100000, 'F') + R"(", "shape": [1], "data_offsets": [0, 4]}})", 4);
    try {
      io::SafetensorsArchive::open(p);
      QFAIL("a 100 000-character dtype was accepted");
    } catch (const Error& e) {
      QVERIFY2(std::string(e.what()).find("100000 characters") != std::string::npos && std::string(e.what()).size() < 400,
               e.what());
    }
    // A FIFO is refused at once (opening it for reading would wait for a writer).
    const auto fifo = dir / "fifo.safetensors";
    QCOMPARE(::mkfifo(fifo.c_str(), 0600), 0);
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(fifo), "fifo.safetensors", "not a regular file");
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(fifo), "fifo.safetensors");
    // A loop of symbolic links.
    fs::create_symlink(dir / "loop_b.safetensors", dir / "loop_a.safetensors");
    fs::create_symlink(dir / "loop_a.safetensors", dir / "loop_b.safetensors");
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "loop_a.safetensors"), "loop_a.safetensors", "symbolic links");
  }

  void rejectsBadShardIndexes() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    std::ofstream(dir / "m.safetensors.index.json") << R"({"weight_map": {"x": "gone.safetensors"}})";
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(dir / "m.safetensors.index.json"), "shard 'gone.safetensors' is missing");
    write_raw(dir, "s1.safetensors", R"({"y": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})", 1);
    std::ofstream(dir / "n.safetensors.index.json") << R"({"weight_map": {"x": "s1.safetensors", "y": "s1.safetensors"}})";
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(dir / "n.safetensors.index.json"), "absent from their shard", "x (in s1.safetensors)");
    std::ofstream(dir / "o.safetensors.index.json") << R"({"metadata": {}})";
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(dir / "o.safetensors.index.json"), "no 'weight_map'");
  }

  void namesMissingTensor() {
    auto archive = io::SafetensorsArchive::open(test::fixtures() / "dtypes.safetensors");
    DIFFRACT_EXPECT_ERROR(archive->at("nope"), "dtypes.safetensors", "no tensor 'nope'");
    DIFFRACT_EXPECT_ERROR(io::SafetensorsArchive::open(test::fixtures() / "absent.safetensors"), "absent.safetensors", "no such file");
  }
};

QTEST_GUILESS_MAIN(TestSafetensors)
#include "test_safetensors.moc"
