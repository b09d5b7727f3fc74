// A policy as asked for, before make_policy resolves it (policy.h): its name, its budget split, its probe and the
// options of a scoring policy. Each option is declared once, as a field of PolicyConfig and a row of
// policy_options() (keyword, label suffix, what leaving it out means, range, meaning): the Python values, the
// policy labels ("tova-256+s4+q32+p9+f12+r32+reply"), the CLI's flags and the docs are made from the rows. What an option
// does is the rule's business (RankedPolicy::select); the default policy's choice of them lives here too.
//
// A leaf: no llama.cpp, no Policy. Labels are written from a resolved policy in policy.cpp (policy_label).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace h2o {

// < 0: not given (the policy's own default, or the option's `unset`)
struct PolicyConfig {
    std::string name = "h2o";
    int32_t budget = -1; // KV entries kept per sequence; < 0: none (only unbounded policies accept that)
    int32_t heavy  = -1;
    int32_t recent = -1;
    int32_t sinks  = -1;
    int32_t query_window = -1; // queries at a prompt's end that score it (Policy::query_window)
    std::string probe;   // what ranks the prompt before it is evicted (probe_source_from_name): "" none, "question",
                         // "repeat", "catalyst"
    int32_t question = -1; // the question probe's length: a prompt's last N tokens; < 0: kDefaultQuestionTokens
    // the options of a scoring policy: rows of policy_options()
    int32_t pool   = -1;
    int32_t follow = -1;
    int32_t block  = -1;
    int32_t probe_share = -1;
    int32_t per_head = -1; // a flag: 1 on, 0 off
    int32_t reply = -1;    // a flag
    int32_t handoff = -1;  // a flag
    int32_t recall_pages = -1; // pages a recall step probes past which it ranks on the host (0: every page)
    int32_t reread = -1;       // tokens of the store's dropped text a recall step may read again (0: none)
};

// One option of a scoring policy.
struct PolicyOption {
    const char * name;      // the keyword: "pool" (Python's; the CLI's --pool)
    const char * suffix;    // the label's: "p" for "+p9"; a flag's whole suffix ("ph")
    int32_t PolicyConfig::* field;
    int32_t unset;          // what not giving it means (a label then leaves it out)
    int32_t minimum;
    int32_t maximum;
    const char * unit;      // for messages: "entries", "percent"; "" for a flag
    bool flag;              // on (1) or off rather than a number
    const char * help;
};

// in the order a label writes them (flags after the recent window)
const std::vector<PolicyOption> & policy_options();
// nullptr when `name` is no option
const PolicyOption * find_policy_option(const std::string & name);
// cfg's value of `option`: as given, or its unset value
int32_t option_value(const PolicyConfig & cfg, const PolicyOption & option);

// what one label suffix sets ("s4" sinks, "w8" query_window, "r192" recent, "q32" the question probe, "repeat" /
// "catalyst" the other probes, and each option's: "p9", "ph", ...); false (cfg untouched) when it is no policy suffix
bool apply_label_suffix(PolicyConfig & cfg, const std::string & suffix);
// "tova-256+s4+q32" -> its config ("full" -> the full cache); throws std::invalid_argument when it is no label.
// Each suffix at most once, in any order.
PolicyConfig parse_policy_label(const std::string & text);

// The default policy (Llama(path, budget=B)) with what was given: TOVA ranked by the prompt's own question (the
// question probe, pooled over 9 entries and the 12 before each), min(4, B / 8) attention sinks, a recent window of
// min(32, B / 2) and the last exchange kept (reply), the best of the quality suite (docs/quality.md). Fields given stay as given; per_head without a
// probe asked for drops the default's probe (per-head choice takes none). The name given is ignored.
PolicyConfig default_policy_config(PolicyConfig given);

} // namespace h2o
