#include "ui/wheel_guard.h"

#include <QAbstractSpinBox>
#include <QComboBox>
#include <QEvent>
#include <QObject>
#include <QSlider>

namespace diffract::ui {

namespace {

class WheelGuard : public QObject {
 public:
  using QObject::QObject;

 protected:
  bool eventFilter(QObject* watched, QEvent* event) override {
    if (event->type() == QEvent::Wheel) {
      auto* w = static_cast<QWidget*>(watched);
      if (!w->hasFocus()) {
        event->ignore();  // handled here, not accepted: Qt hands it on to the parents (the scroll area)
        return true;
      }
    }
    return false;
  }
};

}  // namespace

void guardWheel(QWidget* root) {
  auto* guard = new WheelGuard(root);
  const auto install = [&](QWidget* w) {
    w->setFocusPolicy(Qt::StrongFocus);
    w->installEventFilter(guard);
  };
  for (auto* w : root->findChildren<QAbstractSpinBox*>()) install(w);
  for (auto* w : root->findChildren<QComboBox*>()) install(w);
  for (auto* w : root->findChildren<QSlider*>()) install(w);
}

}  // namespace diffract::ui
