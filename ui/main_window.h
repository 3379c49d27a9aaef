#pragma once
#include <QMainWindow>

namespace diffract::ui {

// The application window. For now it shows what the engine can run; the generation
// controls arrive with the GUI issue.
class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  explicit MainWindow(QWidget* parent = nullptr);
};

}  // namespace diffract::ui
