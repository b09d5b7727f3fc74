// Which dropped text a recall step reads again (the policy option reread). Past its cap the host store keeps only the
// tokens of what it drops (HostStore::Parts::text_tokens); a later question's rarer tokens find the windows of that
// text which hold them, and those are decoded again, so that a chat longer than any store still finds what it was
// told (recall then ranks them with everything else the store holds).
#pragma once

#include "llama.h"

#include <cstddef>
#include <vector>

namespace h2o {

constexpr size_t kRereadWindow = 64; // tokens of dropped text one window holds

// The indices into `tokens` (the dropped text in the conversation's order) of the windows to read again, ascending:
// the text cut into windows of `window` entries, each scored by the question's distinct tokens it holds,
// a token weighing by how few windows hold it (BM25's idf, ln((N - n + 0.5)/(n + 0.5)): nothing from half the
// windows on); the best windows while they fit in `max_tokens`, never one that holds no weighed token.
std::vector<size_t> reread_choice(const std::vector<llama_token> & tokens, const std::vector<llama_token> & question,
                                  size_t window, size_t max_tokens);

} // namespace h2o
