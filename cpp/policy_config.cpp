#include "policy_config.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace h2o {

namespace {

constexpr int32_t kAny = std::numeric_limits<int32_t>::max();

// the default policy's choices (default_policy_config)
constexpr int32_t kDefaultPool   = 9;
constexpr int32_t kDefaultFollow = 12;
constexpr int32_t kDefaultSinks  = 4;  // at most, and at most budget / 8
constexpr int32_t kDefaultRecent = 32; // at most, and at most budget / 2
constexpr int32_t kDefaultRecallPages = 8; // every page up to 8 (as before), then the 8 the host ranking finds
constexpr int32_t kDefaultReread = 256;    // four windows of dropped text a step (SmolLM2 on 2 CPU cores: ~1 s)

// "123" -> 123: ASCII digits only, at most 9 of them (below 2^31); -1 otherwise
int32_t label_number(const std::string & text) {
    if (text.empty() || text.size() > 9 || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        return -1;
    }
    return (int32_t) std::stol(text);
}

// the int fields a label can set, for "each suffix at most once"
std::vector<int32_t PolicyConfig::*> label_fields() {
    std::vector<int32_t PolicyConfig::*> fields = {&PolicyConfig::sinks, &PolicyConfig::query_window,
                                                   &PolicyConfig::recent, &PolicyConfig::question};
    for (const PolicyOption & o : policy_options()) {
        fields.push_back(o.field);
    }
    return fields;
}

std::string suffix_help() {
    std::string out = "+sN (sinks), +wN (query window), +rN (recent entries), +qN (the question probe), +repeat or "
                      "+catalyst (the query-agnostic probes)";
    for (const PolicyOption & o : policy_options()) {
        out += std::string(", +") + o.suffix + (o.flag ? "" : "N") + " (" + o.name + ")";
    }
    return out;
}

} // namespace

const std::vector<PolicyOption> & policy_options() {
    static const std::vector<PolicyOption> options = {
        {"pool", "p", &PolicyConfig::pool, 1, 1, kAny, "entries", false,
         "rank each entry by the best of the N entries centred on it, so that a fact's neighbours go with it"},
        {"follow", "f", &PolicyConfig::follow, 0, 0, kAny, "entries", false,
         "and by the best of the N entries before it: what follows an entry a probe found (a value after its key) "
         "is kept with it"},
        {"block", "b", &PolicyConfig::block, 1, 1, kAny, "positions", false,
         "and by the best entry of its block of N positions, so that what is kept (and recalled) comes in whole "
         "blocks, as the pages of paged caches do"},
        {"probe_share", "m", &PolicyConfig::probe_share, 100, 0, 100, "percent", false,
         "with a probe: the percent of the heavy entries the probe's ranking chooses; the rest by the scorer's own "
         "rank (tova: what the newest query looks at)"},
        {"per_head", "ph", &PolicyConfig::per_head, 0, 0, 1, "", true,
         "H2O's published rule: every layer and KV head keeps its own entries by its own scores, inside the same "
         "budget of cells (attention scorers only, no probe, no position rolling)"},
        {"reply", "reply", &PolicyConfig::reply, 0, 0, 1, "", true,
         "with a probe: the last exchange (the previous prompt's question, its last `question` tokens, and the "
         "answer generated after it) is kept before what a new prompt's probe ranks, until another answer follows, "
         "so that a conversation's next answer still reads the last one"},
        {"handoff", "handoff", &PolicyConfig::handoff, 0, 0, 1, "", true,
         "with recall: while a new prompt's question ranks what comes back, the recent window protects only what the "
         "prompt will not replace (recent - the prompt's tokens, at least 1): its place goes to what the question "
         "finds, as the prompt's own tokens are the recent window after it"},
        {"recall_pages", "d", &PolicyConfig::recall_pages, kDefaultRecallPages, 0, kAny, "pages", false,
         "with recall: past N pages (a batch of entries each; at least the budget's worth) of host memory, a new "
         "prompt's question probes only the N pages whose entries its queries lift most against the stored keys, "
         "so that the step does not grow with the history; 0: every page"},
        {"reread", "t", &PolicyConfig::reread, kDefaultReread, 0, kAny, "tokens", false,
         "with recall: past its cap the host store keeps only the tokens of the oldest text; a new prompt's question "
         "reads again up to N tokens of it, the windows of 64 that hold the question's rarer tokens, so that recall "
         "can bring them back however long the chat; 0: what the cap drops is forgotten"},
    };
    return options;
}

const PolicyOption * find_policy_option(const std::string & name) {
    for (const PolicyOption & o : policy_options()) {
        if (name == o.name) {
            return &o;
        }
    }
    return nullptr;
}

int32_t option_value(const PolicyConfig & cfg, const PolicyOption & option) {
    const int32_t v = cfg.*option.field;
    return v < 0 ? option.unset : v;
}

bool apply_label_suffix(PolicyConfig & cfg, const std::string & suffix) {
    if (suffix == "repeat" || suffix == "catalyst") {
        cfg.probe = suffix;
        return true;
    }
    for (const PolicyOption & o : policy_options()) {
        if (o.flag && suffix == o.suffix) {
            cfg.*o.field = 1;
            return true;
        }
    }
    const int32_t value = suffix.empty() ? -1 : label_number(suffix.substr(1));
    if (value < 0) {
        return false;
    }
    switch (suffix[0]) {
        case 's': cfg.sinks = value; return true;
        case 'w': cfg.query_window = value; return true;
        case 'r': cfg.recent = value; return true;
        case 'q': cfg.question = value; cfg.probe = "question"; return true;
        default: break;
    }
    for (const PolicyOption & o : policy_options()) {
        if (!o.flag && suffix[0] == o.suffix[0] && o.suffix[1] == '\0') {
            cfg.*o.field = value;
            return true;
        }
    }
    return false;
}

PolicyConfig parse_policy_label(const std::string & text) {
    PolicyConfig cfg;
    if (text == "full") {
        cfg.name = "full";
        return cfg;
    }
    const auto not_a_label = [&]() {
        return std::invalid_argument("not a policy label: '" + text + "' (expected NAME-BUDGET with optional " +
                                     suffix_help() + ", for example h2o-128, h2o-128+s4, snapkv-256+w64, "
                                     "tova-256+s4+r192, tova-256+repeat+p5)");
    };
    const size_t dash = text.find('-');
    if (dash == std::string::npos || dash == 0) {
        throw not_a_label();
    }
    cfg.name = text.substr(0, dash);
    std::string rest = text.substr(dash + 1);
    const size_t plus = rest.find('+');
    cfg.budget = label_number(rest.substr(0, plus));
    if (cfg.budget < 0) {
        throw not_a_label();
    }
    for (size_t at = plus; at != std::string::npos; ) {
        const size_t next = rest.find('+', at + 1);
        PolicyConfig one;
        one.name.clear();
        if (!apply_label_suffix(one, rest.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1))) {
            throw not_a_label();
        }
        for (const auto field : label_fields()) {
            if (one.*field >= 0) {
                if (cfg.*field >= 0) {
                    throw not_a_label(); // each suffix once
                }
                cfg.*field = one.*field;
            }
        }
        if (!one.probe.empty()) {
            if (!cfg.probe.empty()) {
                throw not_a_label();
            }
            cfg.probe = one.probe;
        }
        at = next;
    }
    return cfg;
}

PolicyConfig default_policy_config(PolicyConfig cfg) {
    const bool probe_asked = !cfg.probe.empty() || cfg.question >= 0 || cfg.probe_share >= 0;
    cfg.name = "tova";
    if (cfg.probe.empty() && !(cfg.per_head == 1 && !probe_asked)) {
        cfg.probe = "question";
    }
    if (cfg.reply < 0 && !cfg.probe.empty()) {
        cfg.reply = 1; // a conversation's next answer reads the last one (docs/quality.md, "A conversation's next answer")
    }
    cfg.pool = cfg.pool < 0 ? kDefaultPool : cfg.pool;
    cfg.follow = cfg.follow < 0 ? kDefaultFollow : cfg.follow;
    if (cfg.budget > 0) {
        // the question probe ranks by lift over the attention an entry usually gets: the sinks, which get the most,
        // would rank last, so they are kept by position
        if (cfg.sinks < 0 && cfg.heavy < 0 && cfg.recent < 0) {
            cfg.sinks = std::min(kDefaultSinks, cfg.budget/8);
        }
        const int32_t sinks = std::max(cfg.sinks, 0);
        if (cfg.recent < 0 && cfg.heavy < 0 && sinks < cfg.budget) {
            cfg.recent = std::min(std::max(1, std::min(kDefaultRecent, cfg.budget/2)), cfg.budget - sinks);
        }
    }
    return cfg;
}

} // namespace h2o
