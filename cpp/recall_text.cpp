#include "recall_text.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

namespace h2o {

std::vector<size_t> reread_choice(const std::vector<llama_token> & tokens, const std::vector<llama_token> & question,
                                  size_t window, size_t max_tokens) {
    if (tokens.empty() || question.empty() || window == 0 || max_tokens == 0) {
        return {};
    }
    const size_t n_windows = (tokens.size() + window - 1)/window;
    const std::unordered_set<llama_token> asked(question.begin(), question.end());
    // which asked tokens each window holds, and in how many windows each is
    std::vector<std::vector<llama_token>> held(n_windows);
    std::unordered_map<llama_token, size_t> windows_holding;
    for (size_t w = 0; w < n_windows; ++w) {
        std::unordered_set<llama_token> seen;
        for (size_t i = w*window; i < std::min(tokens.size(), (w + 1)*window); ++i) {
            if (asked.count(tokens[i]) > 0 && seen.insert(tokens[i]).second) {
                held[w].push_back(tokens[i]);
                ++windows_holding[tokens[i]];
            }
        }
    }
    const double n = (double) n_windows;
    std::vector<std::pair<double, size_t>> scored; // (score, window)
    for (size_t w = 0; w < n_windows; ++w) {
        double score = 0.0;
        for (const llama_token t : held[w]) {
            const double k = (double) windows_holding[t];
            score += std::max(0.0, std::log((n - k + 0.5)/(k + 0.5)));
        }
        if (score > 0.0) {
            scored.emplace_back(score, w);
        }
    }
    // best first; between equals the later text (nearer the question)
    std::sort(scored.begin(), scored.end(), [](const auto & a, const auto & b) {
        return a.first != b.first ? a.first > b.first : a.second > b.second;
    });
    std::vector<size_t> out;
    for (const auto & [score, w] : scored) {
        const size_t a = w*window, b = std::min(tokens.size(), (w + 1)*window);
        if (out.size() + (b - a) > max_tokens) {
            break;
        }
        for (size_t i = a; i < b; ++i) {
            out.push_back(i);
        }
    }
    std::sort(out.begin(), out.end());
    return out;
}

} // namespace h2o
