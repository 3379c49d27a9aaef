// diffract: the desktop application.
#include <QApplication>
#include <QCommandLineParser>

#include "ui/main_window.h"

int main(int argc, char** argv) {
  QApplication app(argc, argv);
  QApplication::setApplicationName(QStringLiteral("Diffract"));
  QApplication::setOrganizationName(QStringLiteral("Diffract"));
  QApplication::setApplicationVersion(QStringLiteral(DIFFRACT_VERSION));
  QCommandLineParser parser;
  parser.setApplicationDescription(QStringLiteral("Fast interactive diffusion image generation"));
  parser.addHelpOption();
  parser.addVersionOption();
  parser.addPositionalArgument(QStringLiteral("png"), QStringLiteral("A PNG whose generation parameters to restore"),
                               QStringLiteral("[png]"));
  parser.process(app);

  diffract::ui::MainWindow window;
  window.show();
  if (!parser.positionalArguments().isEmpty()) window.restoreFromPng(parser.positionalArguments().constFirst());
  return QApplication::exec();
}
