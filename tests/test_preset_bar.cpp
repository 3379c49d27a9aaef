// The preset row on its own: shipped presets listed, a broken user preset named, saving and
// selecting a user preset, the template shown.
#include <QComboBox>
#include <QDir>
#include <QFile>
#include <QLabel>
#include <QSignalSpy>
#include <QStandardPaths>

#include "core/engine/preset.h"
#include "test_util.h"
#include "ui/preset_bar.h"

using diffract::ui::PresetBar;
namespace engine = diffract::engine;

class TestPresetBar : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() {
    QStandardPaths::setTestModeEnabled(true);
    QCoreApplication::setOrganizationName("DiffractTests");
    QCoreApplication::setApplicationName("test_preset_bar");
    QDir(PresetBar::userPresetDir()).removeRecursively();
  }

  void listsSavesAndSelects() {
    PresetBar bar;
    QVERIFY(bar.reload().isEmpty());
    auto* combo = bar.findChild<QComboBox*>("presetCombo");
    QVERIFY(combo);
    const int shipped = static_cast<int>(bar.presets().size());
    QVERIFY(shipped >= 3);
    QCOMPARE(combo->count(), shipped + 1);
    QCOMPARE(bar.currentName(), QString());
    QCOMPARE(bar.promptTemplate(), QString::fromLatin1(engine::kSubjectPlaceholder));

    engine::Preset p;
    p.name = "Studio shot";
    p.prompt_template = "{subject}, studio light";
    const QString file = bar.save(p);
    QVERIFY(QFile::exists(file));
    QSignalSpy templ(&bar, &PresetBar::templateChanged);
    QVERIFY(bar.reload("Studio shot").isEmpty());
    QCOMPARE(bar.currentName(), QStringLiteral("Studio shot"));
    QCOMPARE(bar.promptTemplate(), QStringLiteral("{subject}, studio light"));
    QCOMPARE(templ.count(), 1);
    QCOMPARE(templ[0][1].toBool(), true);
    auto* label = bar.findChild<QLabel*>("promptTemplateLabel");
    QVERIFY(label->text().contains("studio light"));

    // Picking it in the combo applies it; a broken file is named, not fatal.
    QSignalSpy applied(&bar, &PresetBar::applied);
    combo->activated(combo->currentIndex());
    QCOMPARE(applied.count(), 1);
    QFile bad(QDir(PresetBar::userPresetDir()).filePath("broken.json"));
    QVERIFY(bad.open(QIODevice::WriteOnly));
    bad.write("{not json");
    bad.close();
    const QStringList problems = bar.reload();
    QCOMPARE(problems.size(), 1);
    QVERIFY(problems.front().contains("broken.json"));
    QCOMPARE(combo->count(), shipped + 2);
  }
};

QTEST_MAIN(TestPresetBar)
#include "test_preset_bar.moc"
