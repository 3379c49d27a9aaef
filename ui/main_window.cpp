#include "ui/main_window.h"

#include <QLabel>

#include "core/util/build_info.h"

namespace diffract::ui {

MainWindow::MainWindow(QWidget* parent) : QMainWindow(parent) {
  setWindowTitle(QStringLiteral("Diffract"));
  auto* label = new QLabel(QString::fromStdString(describe(build_info())), this);
  label->setObjectName(QStringLiteral("buildInfoLabel"));
  label->setAlignment(Qt::AlignCenter);
  label->setWordWrap(true);
  setCentralWidget(label);
  resize(960, 640);
}

}  // namespace diffract::ui
