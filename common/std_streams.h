// The standard streams of a command-line program, made safe before it opens
// anything.
#ifndef HAP_COMMON_STD_STREAMS_H_
#define HAP_COMMON_STD_STREAMS_H_

namespace hap::tools {

// Standard input and error, when closed, are opened on /dev/null: with
// their numbers free, the first file or socket the program opened took one
// and an error message went into it. Returns false when standard output is
// closed, which the caller refuses: what it prints would go into whatever
// took descriptor 1 (an output file, a socket; a training run wrote its
// losses there and failed only at its end).
bool ReserveStandardStreams();

}  // namespace hap::tools

#endif  // HAP_COMMON_STD_STREAMS_H_
