// The mask editor driven with the mouse and its tool bar: brush, eraser, clear, invert, fill,
// undo / redo, overlay; zoom and pan keep working.
#include <QSignalSpy>
#include <QSpinBox>
#include <QToolButton>
#include <QWheelEvent>

#include "test_util.h"
#include "ui/mask_editor.h"

using diffract::ui::MaskEditor;
using diffract::ui::MaskEditorPane;

namespace {

QImage photo() {
  QImage img(200, 100, QImage::Format_RGB32);
  img.fill(QColor(30, 120, 200));
  return img;
}

int painted(const QImage& mask) {
  int n = 0;
  for (int y = 0; y < mask.height(); ++y)
    for (int x = 0; x < mask.width(); ++x) n += mask.pixelColor(x, y).value() > 127;
  return n;
}

template <typename T>
T* child(QWidget& w, const char* name) {
  auto* c = w.findChild<T*>(QString::fromLatin1(name));
  if (!c) qFatal("no child %s", name);
  return c;
}

}  // namespace

class TestMaskEditor : public QObject {
  Q_OBJECT
 private slots:
  void paintsErasesAndUndoes() {
    MaskEditorPane pane;
    pane.resize(420, 260);
    pane.show();
    QVERIFY(QTest::qWaitForWindowExposed(&pane));
    MaskEditor* e = pane.editor();
    e->setInputImage(photo());
    QVERIFY(!e->hasMask());
    QCOMPARE(e->mask().size(), QSize(200, 100));
    QSignalSpy changed(e, &MaskEditor::maskChanged);

    child<QSpinBox>(pane, "maskBrushSize")->setValue(10);
    const QPoint c = e->rect().center();
    QTest::mousePress(e, Qt::LeftButton, Qt::NoModifier, c - QPoint(40, 0));
    QTest::mouseMove(e, c);
    QTest::mouseMove(e, c + QPoint(40, 0));
    QTest::mouseRelease(e, Qt::LeftButton, Qt::NoModifier, c + QPoint(40, 0));
    QVERIFY(changed.count() >= 3);
    QCOMPARE(e->mask().pixelColor(100, 50).value(), 255);
    QCOMPARE(e->mask().pixelColor(100, 5).value(), 0);
    const int stroke = painted(e->mask());
    QVERIFY(stroke > 100);

    // The eraser takes part of it away; undo brings it back, redo removes it again.
    QTest::mouseClick(child<QToolButton>(pane, "maskEraser"), Qt::LeftButton);
    QTest::mouseClick(e, Qt::LeftButton, Qt::NoModifier, c);
    QCOMPARE(e->mask().pixelColor(100, 50).value(), 0);
    QVERIFY(painted(e->mask()) < stroke);
    QTest::mouseClick(child<QToolButton>(pane, "maskUndo"), Qt::LeftButton);
    QCOMPARE(painted(e->mask()), stroke);
    QTest::mouseClick(child<QToolButton>(pane, "maskRedo"), Qt::LeftButton);
    QVERIFY(painted(e->mask()) < stroke);

    // Invert, fill and clear, each undoable.
    QTest::mouseClick(child<QToolButton>(pane, "maskFill"), Qt::LeftButton);
    QCOMPARE(painted(e->mask()), 200 * 100);
    QTest::mouseClick(child<QToolButton>(pane, "maskInvert"), Qt::LeftButton);
    QCOMPARE(painted(e->mask()), 0);
    QVERIFY(!e->hasMask());
    QTest::mouseClick(child<QToolButton>(pane, "maskUndo"), Qt::LeftButton);
    QCOMPARE(painted(e->mask()), 200 * 100);
    QTest::mouseClick(child<QToolButton>(pane, "maskClear"), Qt::LeftButton);
    QVERIFY(!e->hasMask());
    QVERIFY(child<QToolButton>(pane, "maskUndo")->isEnabled());

    // The overlay hides and shows without touching the mask.
    QTest::mouseClick(child<QToolButton>(pane, "maskOverlay"), Qt::LeftButton);
    QVERIFY(!e->overlayVisible());
    QTest::mouseClick(child<QToolButton>(pane, "maskOverlay"), Qt::LeftButton);
    QVERIFY(e->overlayVisible());

    // A new input forgets the mask and its history.
    e->setInputImage(photo());
    QVERIFY(!e->canUndo() && !e->hasMask());
  }

  void zoomsAndPansWithoutPainting() {
    MaskEditor e;
    e.resize(400, 200);
    e.show();
    QVERIFY(QTest::qWaitForWindowExposed(&e));
    e.setInputImage(photo());
    const double fit = e.zoom();
    QWheelEvent wheel(QPointF(200, 100), e.mapToGlobal(QPointF(200, 100)), QPoint(), QPoint(0, 240), Qt::NoButton,
                      Qt::NoModifier, Qt::NoScrollPhase, false);
    QApplication::sendEvent(&e, &wheel);
    QVERIFY(e.zoom() > fit);
    const QPointF before = e.offset();
    QTest::mousePress(&e, Qt::RightButton, Qt::NoModifier, QPoint(200, 100));
    QMouseEvent move(QEvent::MouseMove, QPointF(240, 120), e.mapToGlobal(QPointF(240, 120)), Qt::NoButton,
                     Qt::RightButton, Qt::NoModifier);
    QApplication::sendEvent(&e, &move);
    QTest::mouseRelease(&e, Qt::RightButton, Qt::NoModifier, QPoint(240, 120));
    QCOMPARE(e.offset(), before + QPointF(40, 20));
    QVERIFY(!e.hasMask());  // panning painted nothing
  }

  void restoredMaskIsScaledToTheInput() {
    MaskEditor e;
    e.setInputImage(photo());
    QImage small(50, 25, QImage::Format_Grayscale8);
    small.fill(255);
    e.setMask(small);
    QCOMPARE(e.mask().size(), QSize(200, 100));
    QCOMPARE(painted(e.mask()), 200 * 100);
    QVERIFY(e.canUndo());
  }
};

QTEST_MAIN(TestMaskEditor)
#include "test_mask_editor.moc"
