#include "worker/worker_daemon.h"

int main(int argc, char** argv) {
  return tandem::RunDaemon(argc, argv, tandem::worker::MakeDaemonSpec());
}
