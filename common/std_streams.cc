#include "common/std_streams.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <initializer_list>

namespace hap::tools {

bool ReserveStandardStreams() {
  auto closed = [](int fd) { return fcntl(fd, F_GETFD) == -1 && errno == EBADF; };
  const bool stdout_open = !closed(1);
  for (int fd : {0, 2}) {
    if (!closed(fd)) continue;
    const int null = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (null >= 0 && null != fd) {
      dup2(null, fd);
      close(null);
    }
  }
  return stdout_open;
}

}  // namespace hap::tools
