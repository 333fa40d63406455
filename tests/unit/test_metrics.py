"""`stats_delta`: Smurfs' cumulative figures counted between two snapshots."""

from vllm_smurfs.metrics import stats_delta


def snapshot(steps, drafts, accepted, d0, d1):
    def drafter(name, wins, drafted, acc, weight):
        return {"name": name, "vote_wins": wins, "drafted_tokens": drafted,
                "accepted_tokens": acc, "acceptance": acc / drafted if drafted else 0.0,
                "weight": weight, "alive": True, "steps_late": 0, "engine_steps": 2 * steps,
                "busy_s": 0.05 * steps}
    return {"steps": steps, "proposed_drafts": drafts, "sampled_drafts": drafts // 2,
            "verified_drafts": drafts,
            "verified_draft_tokens": 4 * drafts, "accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "requests_drafted": drafts + 1, "requests_without_draft": 1,
            "steps_without_models": steps // 2, "prefill_takebacks": 0,
            "request_steps": 2 * steps, "request_steps_without_models_free_chain": steps // 3,
            "request_steps_without_models_no_chain": steps // 4,
            "drafter_forwards": 3 * steps, "drafter_tokens": 5 * steps,
            "target_step_s": 0.2 * steps, "wait_s": 0.01 * steps, "proposer_s": 0.02 * steps,
            "drafting_s": 0.01 * steps,
            "drafters": [drafter("a", *d0), drafter("b", *d1)]}


def test_counters_are_subtracted_and_ratios_recomputed():
    before = snapshot(3, 2, 5, (2, 8, 5, 1.1), (0, 8, 1, 0.9))
    after = snapshot(10, 6, 9, (5, 24, 12, 1.5), (1, 24, 2, 0.7))
    delta = stats_delta(after, before)
    assert delta["steps"] == 7 and delta["verified_drafts"] == 4
    assert delta["accepted_tokens"] == 4 and delta["verified_draft_tokens"] == 16
    assert delta["mean_acceptance_length"] == 2.0
    assert delta["target_step_s"] == 1.4 and delta["requests_drafted"] == 4
    assert delta["steps_without_models"] == 4
    assert delta["request_steps"] == 14
    assert (delta["request_steps_without_models_free_chain"],
            delta["request_steps_without_models_no_chain"]) == (2, 2)
    assert (delta["drafter_forwards"], delta["drafter_tokens"]) == (21, 35)
    assert delta["drafting_s"] == 0.07
    assert delta["drafters"][0]["engine_steps"] == 14
    assert delta["drafters"][0]["busy_s"] == 0.35
    a, b = delta["drafters"]
    assert (a["vote_wins"], a["drafted_tokens"], a["accepted_tokens"]) == (3, 16, 7)
    assert a["acceptance"] == round(7 / 16, 4)
    assert (b["vote_wins"], b["drafted_tokens"], b["accepted_tokens"]) == (1, 16, 1)
    # Weights and health describe the later snapshot.
    assert (a["weight"], b["weight"]) == (1.5, 0.7)


def test_no_drafts_between_snapshots():
    same = snapshot(3, 2, 5, (2, 8, 5, 1.1), (0, 8, 1, 0.9))
    delta = stats_delta(same, same)
    assert delta["mean_acceptance_length"] is None
    assert [d["acceptance"] for d in delta["drafters"]] == [0.0, 0.0]
