"""The structural fuzzer: the generator, the oracle, the minimiser, and a sweep of seeded programs.

The sweep checks memplan's default pipeline on a few hundred programs: most at the small size (every
check but the budget, which costs the most), some at the default size, where the broadcast
intermediates dominate the step's memory and chunk and rewrite act, with every check.
"""

import pytest
import torch
from torch import nn

import memplan.api
from memplan.errors import CaptureError
from memplan.fuzz import (
    CHECKS,
    FAMILIES,
    StructuralProgram,
    check_program,
    minimise,
    same_failure,
    structural_program,
)

# Seeds of the sweep. Small programs plan in a fraction of a second; default-size ones take seconds
# (chunking a dominant intermediate is what costs), so there are fewer of them.
SMALL_SEEDS = range(0, 240)
DEFAULT_SEEDS = range(100_000, 100_012)
FAST_CHECKS = tuple(c for c in CHECKS if c != "budget")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The programs are small: a second intra-op thread only adds synchronisation (milliseconds per
    op when the machine is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _outputs_and_grads(model, inputs):
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    torch.manual_seed(0)
    out = model(*xs)
    diff = [t for t in out if t.requires_grad]
    leaves = [x for x in xs if x.requires_grad] + list(model.parameters())
    grads = torch.autograd.grad([t.sum() for t in diff], leaves, allow_unused=True)
    return [t.detach() for t in out], [g for g in grads if g is not None]


# ----------------------------------------------------------------------------------------------
# the generator


def test_a_seed_gives_the_same_program_and_inputs():
    (a, xs), (b, ys) = structural_program(11), structural_program(11)
    assert a.program == b.program
    assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert structural_program(12)[0].program != a.program


def test_drawing_a_program_leaves_the_global_generator_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    structural_program(0, families=["random", "attention"], blocks=(2, 2))
    assert torch.equal(torch.rand(4), expected)


def test_every_family_is_drawn_from_the_default_mix():
    drawn = set()
    for seed in range(60):
        drawn.update(structural_program(seed, size="small")[0].program.families)
    assert drawn == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_to_source_builds_the_same_module_and_inputs(family):
    model, inputs = structural_program(3, families=[family], blocks=(2, 2))
    namespace = {}
    exec(model.program.to_source(), namespace)
    out_a, grads_a = _outputs_and_grads(model, inputs)
    out_b, grads_b = _outputs_and_grads(namespace["model"], namespace["inputs"])
    assert len(out_a) == len(out_b) and len(grads_a) == len(grads_b) > 0
    for a, b in zip(out_a + grads_a, out_b + grads_b):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_programs_reach_the_ranks_and_dtypes_the_passes_meet():
    ranks, dtypes = set(), set()
    for seed in range(80):
        program = structural_program(seed, size="small")[0].program
        for statement in program.statements:
            ranks.update(len(shape) for shape in statement.shapes)
            dtypes.update(statement.dtypes)
        dtypes.update(leaf.dtype for leaf in program.leaves)
    assert {2, 3, 4, 5} <= ranks
    assert {"torch.float32", "torch.int64"} <= dtypes


@pytest.mark.parametrize("family", ["pairwise", "chamfer", "logspace_matmul", "einsum_reduce", "broadcast_matmul"])
def test_the_reducing_families_are_sized_so_their_intermediate_dominates(family):
    from memplan.measure import measure
    from memplan.steps import step_fn

    model, inputs = structural_program(0, families=[family], blocks=(1, 1))
    leaves = sum(t.nbytes for t in (*inputs, *model.parameters()))
    assert measure(step_fn(model, inputs, train=True)).peak >= 4 * leaves


def test_unknown_families_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown families \\['pairwse'\\]"):
        structural_program(0, families=["pairwse"])


# ----------------------------------------------------------------------------------------------
# program edits and the minimiser


def _ancestors(program: StructuralProgram, index: int) -> set[int]:
    """Indices of the statements that statement ``index`` reads, transitively, and itself."""
    defines = {out: i for i, s in enumerate(program.statements) for out in s.outs}
    found, stack = set(), [index]
    while stack:
        i = stack.pop()
        if i not in found:
            found.add(i)
            stack.extend(defines[a] for a in program.statements[i].args if a in defines)
    return found


def test_without_drops_the_readers_of_what_it_drops():
    program = structural_program(5, blocks=(3, 3))[0].program
    first = program.statements[0]
    smaller = program.without([0])
    if smaller is not None:
        names = {out for s in smaller.statements for out in s.outs}
        assert not names & set(first.outs)
        assert all(not set(s.args) & set(first.outs) for s in smaller.statements)
        read = {a for s in smaller.statements for a in s.args} | set(smaller.outputs)
        assert {leaf.name for leaf in smaller.leaves} <= read  # leaves nothing reads are gone
        smaller.build()[0](*smaller.build()[1])  # and it still runs
    assert program.without(range(len(program.statements))) is None


def test_minimise_keeps_what_the_predicate_needs_and_drops_the_rest():
    program = structural_program(8, blocks=(3, 3))[0].program
    target = program.statements[-1].op
    calls = []

    def needs_target(candidate):
        calls.append(candidate)
        return any(s.op == target for s in candidate.statements)

    small = minimise(program, needs_target)
    assert needs_target(small)
    kept = [i for i, s in enumerate(small.statements) if s.op == target]
    needed = set().union(*(_ancestors(small, i) for i in kept))
    assert set(range(len(small.statements))) == needed  # nothing but the target and what it reads
    small.build()[0](*small.build()[1])


def test_minimise_respects_its_budget_of_tries():
    program = structural_program(8, blocks=(3, 3))[0].program
    calls = []
    minimise(program, lambda p: calls.append(p) or False, max_tries=5)
    assert len(calls) <= 5


# ----------------------------------------------------------------------------------------------
# the oracle, on optimizers that are wrong on purpose


class _Wrapped(nn.Module):
    """An "optimized" module that runs the model and then ``after`` on its outputs."""

    def __init__(self, model, after):
        super().__init__()
        self.model = model
        self.after = after

    def forward(self, *args):
        return self.after(self.model(*args))


def _optimizer(after):
    def optimize(model, **settings):
        return _Wrapped(model, after)

    return optimize


@pytest.fixture
def small_program():
    return structural_program(4, families=["norm"], blocks=(1, 1), size="small")


def test_the_oracle_reports_outputs_that_differ(monkeypatch, small_program):
    monkeypatch.setattr(memplan.api, "optimize", _optimizer(lambda out: tuple(t + 1e-3 for t in out)))
    findings = check_program(*small_program, checks=("equivalence", "inference"))
    assert [f.kind for f in findings] == ["output", "inference"]
    assert all(f.failed and f.seed == 4 and f.program == small_program[0].program for f in findings)


def test_the_oracle_reports_errors_and_capture_errors_and_stops(monkeypatch, small_program):
    def broken(out):
        raise KeyError("lost node")

    monkeypatch.setattr(memplan.api, "optimize", _optimizer(broken))
    (finding,) = check_program(*small_program)
    assert (finding.kind, finding.check, finding.where) == ("error", "equivalence", "KeyError")

    def uncapturable(out):
        raise CaptureError("cannot capture")

    monkeypatch.setattr(memplan.api, "optimize", _optimizer(uncapturable))
    (finding,) = check_program(*small_program, checks=("inference",))
    assert (finding.kind, finding.check) == ("capture", "inference")


def test_the_oracle_compares_two_consecutive_random_calls(monkeypatch):
    program = structural_program(0, families=["random"], blocks=(1, 1), size="small")

    def one_draw_more(out):  # the second call draws from a generator the first advanced
        torch.rand(1)
        return out

    monkeypatch.setattr(memplan.api, "optimize", _optimizer(one_draw_more))
    (finding,) = check_program(*program, checks=("random",))
    assert finding.kind == "random" and "consecutive calls" in finding.message


def test_the_oracle_measures_peaks_and_budgets(monkeypatch, small_program):
    def hoard(out):  # a 4 MB allocation no step frees
        hoard.kept.append(torch.ones(1 << 20))
        return out

    hoard.kept = []
    monkeypatch.setattr(memplan.api, "optimize", _optimizer(hoard))
    assert [f.kind for f in check_program(*small_program, checks=("peak", "budget"))] == ["peak", "budget"]


def test_ill_conditioned_programs_are_skipped_not_failed():
    class Amplifier(nn.Module):
        def forward(self, x):
            return torch.sin(torch.exp(torch.exp(x + 2)))

    (finding,) = check_program(Amplifier(), (torch.rand(8, 4, requires_grad=True) * 3,))
    assert finding.kind == "ill-conditioned" and not finding.failed


def test_same_failure_shrinks_a_program_to_the_statement_that_breaks(monkeypatch):
    # a fake bug: the "optimized" model is wrong whenever the program has a logsumexp
    def optimize(model, **settings):
        broken = any(s.op == "logsumexp" for s in model.program.statements)
        return _Wrapped(model, lambda out: tuple(t * 1.01 if broken and t.is_floating_point() else t for t in out))

    monkeypatch.setattr(memplan.api, "optimize", optimize)
    model, inputs = structural_program(9, families=["logspace_matmul", "norm", "views"], blocks=(3, 3), size="small")
    assert any(s.op == "logsumexp" for s in model.program.statements)
    finding = next(f for f in check_program(model, inputs, checks=("equivalence",)) if f.failed)
    small = minimise(model.program, same_failure(finding))
    assert [s.op for s in small.statements] == ["logsumexp"]
    assert "logsumexp" in small.to_source()


# ----------------------------------------------------------------------------------------------
# the sweep


def _report(findings):
    failures = [f for f in findings if f.failed]
    lines = [str(f) for f in failures]
    if failures and failures[0].program is not None:
        lines += ["", failures[0].program.to_source()]
    return "\n".join(lines)


@pytest.mark.parametrize("seed", SMALL_SEEDS)
def test_small_structural_programs_pass_the_oracle(seed):
    model, inputs = structural_program(seed, size="small")
    findings = check_program(model, inputs, checks=FAST_CHECKS)
    assert not [f for f in findings if f.failed], _report(findings)


@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_structural_programs_pass_the_oracle(seed):
    model, inputs = structural_program(seed)
    findings = check_program(model, inputs)
    assert not [f for f in findings if f.failed], _report(findings)


# Programs the long runs of benchmarks/fuzz.py found, each fixed at its rule: the whole oracle must
# pass, and the prediction must hold from both sides (an overestimate is no failure of the sweep, but
# 63, 108, 300 and 471 were overestimated by 5-15% until a loop's first chunk stopped counting its
# results twice, 414 until schedule's candidates took getitems right after their node; 5243's
# gradient cancels from terms ten times its size, and rounds further than the derived tolerance in
# eager itself, so assert_equivalent asks the float64 arbiter; 5289 raised in capture; 5592's leaf
# gradient left a rewrite laid out unlike the leaf; 1145's loop summed zeros a write outside it had
# not yet filled, and 7349's after attention; 1281 made a tangent dense that the backward takes
# broadcast with the others; 7552's chunked softmax over distances, under a budget, came out 2.01x
# eager's distance from float64, which the arbiter allows with the derived tolerance on top; 3561's
# loop concatenated c and c.t() into two results, and a write through one missed the other; 930's
# backward copied a reshape of out.sum()'s broadcast tangent that eager views, and 4826 copied a
# gradient into its leaf's layout, which it keeps when every tangent arrives broadcast; 8745's loop
# wrote its states into slices of an output, and the backward raised unpacking a saved slice; 4525's
# loop, under no_grad, drew a dropout mask per chunk: a random op reading only replicated values, the
# empty_like of a partial sum, joined the region; 1146's leaf gradient, once that reshape viewed the
# broadcast tangent, was a broadcast view autograd copies, uncounted).
FOUND_SEEDS = (63, 108, 300, 414, 471, 930, 1145, 1146, 1281, 3561, 4525, 4826, 5243, 5289, 5592, 7349, 7552, 8745)


@pytest.mark.parametrize("seed", FOUND_SEEDS)
def test_programs_found_by_long_runs_pass_the_oracle_and_are_predicted_within_5_percent(seed):
    model, inputs = structural_program(seed)
    findings = check_program(model, inputs)
    assert not findings, "\n".join(str(f) for f in findings)


# Programs the long runs found whose float32 results are rounding noise, or amplify it past what any
# comparison of two summation orders can judge: 5548's gradient through a cosine similarity's maximum
# (1 on the diagonal) is zero in exact arithmetic; 3394 takes a layer norm of those maxima, which
# multiplies their rounding by 300. They are skipped, not failed.
FOUND_ILL_CONDITIONED = (3394, 5548)


@pytest.mark.parametrize("seed", FOUND_ILL_CONDITIONED)
def test_programs_that_amplify_rounding_are_skipped_as_ill_conditioned(seed):
    model, inputs = structural_program(seed)
    assert [f.kind for f in check_program(model, inputs)] == ["ill-conditioned"]
