"""Scenarios on real SGLang 0.5.15.post1 code (stock wheel, and with slime's image patches), run like
`dp_scenarios.py` (plugin / none / source). The API differs from 0.5.23 (fix map "API differences"):
server args instead of the runtime context, no dp_slot_in, no graph_utils.padded_extend_real_tokens.

EXPECT[variant]: "fixes" {fix: {scenario: needle the stock detail must contain}}, "guards"
[scenarios right with and without the plugin], "registered" (fixes the plugin hooks), "states"
(dp-attention fix states in `patches status`).
"""
import sys

from scenario_runner import main, registry

SCENARIOS, scenario = registry()

EXPECT = {
    "0.5.15.post1": {"fixes": {}, "guards": [], "registered": [], "states": {}},
    "0.5.15.post1+slime": {"fixes": {}, "guards": [], "registered": [], "states": {}},
}

if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
