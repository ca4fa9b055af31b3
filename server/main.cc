#include "server/server_daemon.h"

int main(int argc, char** argv) {
  return tandem::RunDaemon(argc, argv, tandem::server::MakeDaemonSpec());
}
