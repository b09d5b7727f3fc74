// A sequence's snapshot as bytes (a chat session saved to disk) and back: the one byte format, versioned by its magic.
#pragma once

#include "seq_cache.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace h2o {

std::vector<uint8_t> snapshot_to_bytes(const SeqSnapshot & snap);
// throws std::invalid_argument for anything that is not a well-formed snapshot (Engine::restore then checks that it
// matches the engine)
SeqSnapshot snapshot_from_bytes(const uint8_t * data, size_t size);

} // namespace h2o
