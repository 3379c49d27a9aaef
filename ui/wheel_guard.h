#pragma once
// Scrolling a form with the wheel must not change the fields it passes over: spin boxes, combo
// boxes and sliders under `root` take wheel events only once they have the focus (a click or
// Tab); until then the wheel scrolls what holds them.
class QWidget;

namespace diffract::ui {

void guardWheel(QWidget* root);

}  // namespace diffract::ui
