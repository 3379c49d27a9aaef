#include <QLabel>

#include "test_util.h"
#include "ui/main_window.h"

class TestMainWindow : public QObject {
  Q_OBJECT
 private slots:
  void showsBuildInfo() {
    diffract::ui::MainWindow window;
    window.show();
    QVERIFY(QTest::qWaitForWindowExposed(&window));
    auto* label = window.findChild<QLabel*>(QStringLiteral("buildInfoLabel"));
    QVERIFY(label);
    QVERIFY(label->text().startsWith(QStringLiteral("Diffract ")));
    QVERIFY(label->text().contains(QStringLiteral("LibTorch 2.11")));
  }
};

QTEST_MAIN(TestMainWindow)
#include "test_main_window.moc"
