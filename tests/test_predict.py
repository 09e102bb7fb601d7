"""The load predictor's window mean: of counts, equal to the stacked mean value for value, and kept through
a state round trip."""
import torch

from ds_fssdp.planner.predict import LoadPredictor, _mean


def test_mean_of_counts_is_the_stacked_mean_exactly():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n, (E, D) = 1 + trial % 5, [(256, 64), (8, 4), (7, 3)][trial % 3]
        rows = [torch.randint(0, 1 << 20, (E, D), generator=gen).double() for _ in range(n)]
        assert torch.equal(_mean(rows), torch.stack(rows).mean(0)), trial
        floats = [torch.rand(E, D, dtype=torch.float64, generator=gen) for _ in range(n)]
        torch.testing.assert_close(_mean(floats), torch.stack(floats).mean(0), rtol=1e-15, atol=0)
    assert _mean([]) is None


def test_predictions_are_the_window_means_and_survive_a_state_round_trip():
    gen = torch.Generator().manual_seed(1)
    pred = LoadPredictor([6, 6], window=3)
    seen = []
    for _ in range(5):
        tokens_ED = torch.randint(0, 100, (6, 4), generator=gen)
        pred.observe(0, tokens_ED)
        seen.append(tokens_ED.double())
    window = seen[-3:]
    assert torch.equal(pred.predict_tokens(0), torch.stack(window).mean(0))
    assert torch.equal(pred.predict(0), torch.stack([h.sum(1) for h in window]).mean(0))
    assert pred.predict(1) is None and pred.predict_tokens(1) is None
    again = LoadPredictor([6, 6], window=3)
    again.load_state_dict(pred.state_dict())
    assert torch.equal(again.predict(0), pred.predict(0))
    assert torch.equal(again.predict_tokens(0), pred.predict_tokens(0))
    assert again.error(0) == pred.error(0)
