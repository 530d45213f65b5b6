"""Every method of the head-to-head behind one interface: losses in, ``.grad`` filled.

All three libraries follow the same protocol: the K task gradients of the *shared trunk*
are combined by the method, and each head gets the gradient of its own loss. TorchJD
goes through its public ``mtl_backward`` + ``jac_to_grad``; LibMTL's weighting classes
are driven standalone (its package ``__init__`` imports torchvision, which we neither
need nor install, so the ``LibMTL.weighting`` subpackage is loaded on its own).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

import mogradient as mg
from benchmarks.mtl.model import MultiTaskNet


class Method(Protocol):
    def backward(self, model: MultiTaskNet, losses: list[torch.Tensor], features: torch.Tensor):
        """Fill ``.grad`` of every parameter; return the weights used (K floats) or None."""


def extra_parameters(method: Method | None) -> list[torch.nn.Parameter]:
    """Parameters a method learns beside the model (UW's log-variances): Adam steps them too."""
    parameters = getattr(method, "parameters", None)
    return list(parameters()) if parameters is not None else []


def preference_size(method: Method | None, num_tasks: int) -> int:
    """How many preference entries the method's model takes with its input (COSMOS: K, else 0).

    A method whose model is preference-conditioned has ``next_preference()``, called
    before every training forward; evaluation then uses the uniform preference 1/K.
    """
    return num_tasks if hasattr(method, "next_preference") else 0


def head_backward(model: MultiTaskNet, losses: list[torch.Tensor]) -> None:
    """Each head's gradient is its own loss's gradient (the heads share no parameter)."""
    heads = [parameter for head in model.heads for parameter in head.parameters()]
    torch.autograd.backward(torch.stack(losses).sum(), inputs=heads, retain_graph=True)


@dataclass
class Ours:
    """A mogradient harmonizer on the trunk's K x D gradient stack, one HarmonizedStep."""

    harmonizer: mg.Harmonizer
    last: mg.StepReport | None = field(default=None, repr=False)
    step: mg.HarmonizedStep | None = field(default=None, repr=False)

    def bind(self, model: MultiTaskNet) -> None:
        self.step = mg.HarmonizedStep(model.shared_parameters(), self.harmonizer)

    def backward(self, model, losses, features):
        head_backward(model, losses)  # the heads' .grad; the graph stays for the trunk
        separate = mg.CombinableLoss.separate(torch.stack(losses))
        self.last = self.step.solve([(1.0, separate)], len(losses))
        return self.last.weights


@dataclass
class TorchJD:
    """A TorchJD aggregator through ``mtl_backward`` and ``jac_to_grad``."""

    aggregator: Any

    def backward(self, model, losses, features):
        from torchjd.autojac import jac_to_grad, mtl_backward

        shared = model.shared_parameters()
        heads = [list(head.parameters()) for head in model.heads]
        mtl_backward(losses, features=features, shared_params=shared, tasks_params=heads)
        weights = jac_to_grad(shared, self.aggregator)
        return None if weights is None else weights.detach()


@dataclass
class OursFeatures:
    """MGDA-UB: weights solved on the gradients w.r.t. the shared features, one trunk backward."""

    harmonizer: mg.Harmonizer

    def backward(self, model, losses, features):
        heads = [list(head.parameters()) for head in model.heads]
        result = mg.mtl_backward(
            losses,
            features,
            self.harmonizer,
            shared_parameters=model.shared_parameters(),
            head_parameters=heads,
            mode="features",
        )
        return result.weights


@dataclass
class Scalarized:
    """A mogradient scalarization: one backward of the loss it makes of the K losses.

    Built by :meth:`bind` on the model, before the optimizer: methods that read task
    gradients take the model's shared parameters, and UW's or IMTL's scales must exist
    when Adam is given the parameters to step.
    """

    build_method: Callable[[MultiTaskNet], mg.Scalarization]
    method: mg.Scalarization | None = field(default=None, repr=False)

    def bind(self, model: MultiTaskNet) -> None:
        self.method = self.build_method(model)

    def parameters(self) -> list[torch.nn.Parameter]:
        if self.method is None:
            raise RuntimeError("bind(model) first: the scalarization is built on the model")
        return list(self.method.parameters())

    def backward(self, model, losses, features):
        result = self.method(torch.stack(losses))
        result.loss.backward()
        return result.weights.detach().to(torch.float64)

    def after_step(self, recompute_losses: Callable[[], list[torch.Tensor]]) -> None:
        """FAMO learns from the losses after the step, on the same batch."""
        if self.method.needs_losses_after_step:
            with torch.no_grad():
                self.method.update(torch.stack(recompute_losses()))

    def end_epoch(self) -> None:
        self.method.end_epoch()


class ScalarizedCOSMOS(Scalarized):
    """Our COSMOS: a preference drawn per batch, fed to the preference-conditioned model."""

    def next_preference(self) -> torch.Tensor:
        return self.method.next_preference()


@dataclass
class TorchJDScalarized:
    """A TorchJD scalarizer: one backward of the loss it makes of the K losses.

    TorchJD's scalarizers return the loss alone, so there are no weights to record. Their
    learned scales (UW's log-variances, IMTL-L's log-scales) are stepped by the training
    Adam, as ours are; FAMO's logits are not, since FAMO steps them with its own Adam in
    ``update`` (the losses after the step, same batch); DWA rolls its epoch history in
    ``step()`` at the end of every epoch.
    """

    scalarizer: Any

    def parameters(self) -> list[torch.nn.Parameter]:
        from torchjd.scalarization import FAMO

        return [] if isinstance(self.scalarizer, FAMO) else list(self.scalarizer.parameters())

    def backward(self, model, losses, features):
        self.scalarizer(torch.stack(losses)).backward()
        return None

    def after_step(self, recompute_losses: Callable[[], list[torch.Tensor]]) -> None:
        from torchjd.scalarization import FAMO

        if isinstance(self.scalarizer, FAMO):
            with torch.no_grad():
                self.scalarizer.update(torch.stack(recompute_losses()))

    def end_epoch(self) -> None:
        from torchjd.scalarization import DWA

        if isinstance(self.scalarizer, DWA):
            self.scalarizer.step()


@dataclass
class TorchJDCOSMOS(TorchJDScalarized):
    """TorchJD's COSMOS objective on the preference stream our COSMOS row draws.

    The preferences are the benchmark's protocol, not the method: they are drawn by a
    mogradient COSMOS used only as a seeded Dirichlet sampler (its loss is never used), so
    with the same seed both rows see the same preferences and differ in the objective's
    implementation alone.
    """

    sampler: mg.scalarizations.COSMOS

    def next_preference(self) -> torch.Tensor:
        preference = self.sampler.next_preference()
        self.scalarizer.weights = preference.float()
        return preference


def bind(method: Method | None, model: MultiTaskNet) -> None:
    """Let a method that is built on the model (scalarizations, LibMTL's) see it first."""
    binder = getattr(method, "bind", None)
    if binder is not None:
        binder(model)


def libmtl_weighting_module() -> types.ModuleType:
    """``LibMTL.weighting`` without running ``LibMTL/__init__.py`` (which needs torchvision)."""
    if "LibMTL.weighting" in sys.modules:
        return sys.modules["LibMTL.weighting"]
    spec = importlib.util.find_spec("LibMTL")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("LibMTL is not installed: pip install --no-deps LibMTL==1.1.5")
    package = types.ModuleType("LibMTL")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("LibMTL", package)
    return importlib.import_module("LibMTL.weighting")


@dataclass
class LibMTL:
    """A LibMTL weighting's own ``backward`` (it computes the gradients itself).

    Driven as LibMTL's Trainer drives it: its learnable loss scales (UW, GradNorm) are in
    the training optimizer (:meth:`parameters`), and it sees ``epoch`` (0-based) and
    ``train_loss_buffer`` (task x finished epoch: the epoch's mean training loss, the
    losses taken before each step), which DWA and GradNorm read.
    """

    class_name: str
    options: dict[str, Any] = field(default_factory=dict)
    _weighting: Any = field(default=None, repr=False)
    _epoch_losses: list[list[float]] = field(default_factory=list, repr=False)

    def bind(self, model: MultiTaskNet) -> None:
        """Give the weighting the attributes LibMTL's model mixin would have given it."""
        weighting = getattr(libmtl_weighting_module(), self.class_name)()
        weighting.task_num = len(model.heads)
        weighting.device = torch.device("cpu")
        weighting.rep_grad = False
        weighting.get_share_params = model.shared_parameters
        # LibMTL calls encoder.zero_grad(), which since torch 2.0 sets .grad to None and
        # then breaks its own _reset_grad (param.grad.data = ...): zero in place instead.
        weighting.zero_grad_share_params = lambda: model.trunk.zero_grad(set_to_none=False)
        weighting.init_param()
        weighting.epoch = 0
        weighting.train_loss_buffer = np.zeros((len(model.heads), 0))
        self._weighting = weighting
        self._epoch_losses.clear()

    def parameters(self) -> list[torch.nn.Parameter]:
        if self._weighting is None:
            raise RuntimeError("bind(model) first: the weighting is built on the model")
        return list(self._weighting.parameters())

    def backward(self, model, losses, features):
        if self._weighting is None:
            self.bind(model)
        for parameter in model.shared_parameters():
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        self._epoch_losses.append([float(loss.detach()) for loss in losses])
        weights = self._weighting.backward(torch.stack(losses), **self.options)
        return torch.as_tensor(weights, dtype=torch.float64)

    def end_epoch(self) -> None:
        """The Trainer's bookkeeping: the epoch's mean losses join the buffer; epoch + 1.

        The Trainer weighs each batch's loss by its size; every batch here is full, so
        that is the plain mean.
        """
        if not self._epoch_losses:
            return
        mean = np.mean(self._epoch_losses, axis=0)[:, None]
        weighting = self._weighting
        weighting.train_loss_buffer = np.concatenate([weighting.train_loss_buffer, mean], axis=1)
        weighting.epoch += 1
        self._epoch_losses.clear()


@dataclass(frozen=True)
class Spec:
    """A method in the table: its label, library, the K it supports, and a factory."""

    label: str
    library: str
    build: Callable[[int, int], Method]  # (num_tasks, seed) -> method
    min_tasks: int = 2
    only_tasks: int | None = None


def _tjd(name: str, **options: Any) -> Callable[[int, int], Method]:
    def build(num_tasks: int, seed: int) -> Method:
        import torchjd.aggregation as aggregation

        return TorchJD(getattr(aggregation, name)(**options))

    return build


def _tjd_gramian(factory: Callable[[types.ModuleType], Any]) -> Callable[[int, int], Method]:
    """A weighting TorchJD ships without an aggregator (``factory(torchjd.aggregation)``),
    given the Gram J J^T of the one stack, as our harmonizer is."""

    def build(num_tasks: int, seed: int) -> Method:
        import torchjd.aggregation as aggregation

        return TorchJD(aggregation.GramianWeightedAggregator(factory(aggregation)))

    return build


def _tjd_scalar(factory: Callable[[types.ModuleType, int], Any]) -> Callable[[int, int], Method]:
    """A TorchJD scalarizer: ``factory(torchjd.scalarization, num_tasks)``."""

    def build(num_tasks: int, seed: int) -> Method:
        import torchjd.scalarization as scalarization

        return TorchJDScalarized(factory(scalarization, num_tasks))

    return build


def _cosmos(num_tasks: int, seed: int) -> Method:
    """Our COSMOS, its preferences drawn from the run seed."""
    return ScalarizedCOSMOS(
        lambda model: mg.make_scalarization(
            "cosmos",
            num_tasks=num_tasks,
            lam=COSMOS_LAMBDA,
            concentration=COSMOS_CONCENTRATION,
            seed=seed,
        )
    )


def _tjd_cosmos(num_tasks: int, seed: int) -> Method:
    """TorchJD's COSMOS; the sampler's lam is unused (it only draws preferences)."""
    from torchjd.scalarization import COSMOS

    uniform = torch.full((num_tasks,), 1.0 / num_tasks)  # replaced before every call
    sampler = mg.scalarizations.COSMOS(
        num_tasks, lam=0.0, concentration=COSMOS_CONCENTRATION, seed=seed
    )
    return TorchJDCOSMOS(COSMOS(COSMOS_LAMBDA, weights=uniform), sampler)


def _ours(factory: Callable[[int, int], mg.Harmonizer]) -> Callable[[int, int], Method]:
    return lambda num_tasks, seed: Ours(factory(num_tasks, seed))


def _scalar(name: str, **options: Any) -> Callable[[int, int], Method]:
    return lambda num_tasks, seed: Scalarized(
        lambda model: mg.make_scalarization(name, num_tasks=num_tasks, **options)
    )


def _scalar_on(
    shared: Callable[[MultiTaskNet], list[torch.nn.Parameter]], name: str, **options: Any
) -> Callable[[int, int], Method]:
    """A scalarization that reads task gradients on ``shared(model)``."""
    return lambda num_tasks, seed: Scalarized(
        lambda model: mg.make_scalarization(
            name, num_tasks=num_tasks, shared=shared(model), **options
        )
    )


def _trunk(model: MultiTaskNet) -> list[torch.nn.Parameter]:
    return model.shared_parameters()


def _last_shared_layer(model: MultiTaskNet) -> list[torch.nn.Parameter]:
    """GradNorm's W: the trunk's last linear layer (the paper's last shared layer)."""
    return list(model.trunk[-2].parameters())


def _lib(name: str, **options: Any) -> Callable[[int, int], Method]:
    return lambda num_tasks, seed: LibMTL(name, dict(options))


GRADVAC_BETA = 0.01  # the paper's and ours; LibMTL's default is 0.5, TorchJD's 0.5
CAGRAD_C = 0.5
FAIRGRAD_ALPHA = 1.0  # the paper's proportional fairness
STCH_MU = 1.0  # the smoothing; the paper gives no single default
PBI_THETA = 5.0  # MOEA/D's setting; ours and TorchJD's
DWA_TEMPERATURE = 2.0  # the paper's
GRADNORM_ALPHA = 1.5  # LibMTL's default, ours too (the paper tunes it per problem)
# COSMOS's cosine penalty and Dirichlet concentration: the authors' code's Multi-MNIST
# settings (lamda=2, alpha=1.2), the problem nearest to these two-digit canvases.
COSMOS_LAMBDA = 2.0
COSMOS_CONCENTRATION = 1.2

METHODS: dict[str, Spec] = {
    spec.label: spec
    for spec in [
        Spec("EW", "mogradient", _ours(lambda k, s: mg.harmonizers.Mean())),
        Spec("RLW", "mogradient", _ours(lambda k, s: mg.harmonizers.RandomWeights(seed=s))),
        Spec("MGDA", "mogradient", _ours(lambda k, s: mg.harmonizers.MGDA(normalize=False))),
        Spec("MGDA-NR", "mogradient", _ours(lambda k, s: mg.harmonizers.MGDA())),
        Spec("PCGrad", "mogradient", _ours(lambda k, s: mg.harmonizers.PCGrad(seed=s))),
        Spec("CAGrad", "mogradient", _ours(lambda k, s: mg.harmonizers.CAGrad(c=CAGRAD_C))),
        Spec("Nash-MTL", "mogradient", _ours(lambda k, s: mg.harmonizers.NashMTL())),
        Spec("UPGrad", "mogradient", _ours(lambda k, s: mg.harmonizers.UPGrad())),
        Spec("DualProj", "mogradient", _ours(lambda k, s: mg.harmonizers.DualProj())),
        Spec("IMTL-G", "mogradient", _ours(lambda k, s: mg.harmonizers.IMTLG())),
        Spec("Aligned-MTL", "mogradient", _ours(lambda k, s: mg.harmonizers.AlignedMTL())),
        Spec(
            "GradVac",
            "mogradient",
            _ours(lambda k, s: mg.harmonizers.GradVac(beta=GRADVAC_BETA, seed=s)),
        ),
        Spec(
            "Dropout(MGDA-NR)",
            "mogradient",
            _ours(
                lambda k, s: mg.harmonizers.RewardDropout(
                    mg.harmonizers.MGDA(), probability=0.3, seed=s
                )
            ),
        ),
        Spec("ConFIG", "mogradient", _ours(lambda k, s: mg.harmonizers.ConFIG())),
        Spec(
            "FairGrad",
            "mogradient",
            _ours(lambda k, s: mg.harmonizers.FairGrad(alpha=FAIRGRAD_ALPHA)),
        ),
        Spec("ExcessMTL", "mogradient", _ours(lambda k, s: mg.harmonizers.ExcessMTL())),
        Spec("CR-MOGM", "mogradient", _ours(lambda k, s: mg.harmonizers.CRMOGM())),
        Spec("MoDo", "mogradient", _ours(lambda k, s: mg.harmonizers.MoDo())),
        Spec("SDMGrad", "mogradient", _ours(lambda k, s: mg.harmonizers.SDMGrad())),
        Spec("Krum", "mogradient", _ours(lambda k, s: mg.harmonizers.Krum()), min_tasks=3),
        Spec(
            "TrimmedMean",
            "mogradient",
            _ours(lambda k, s: mg.harmonizers.TrimmedMean()),
            min_tasks=3,
        ),
        Spec("GradDrop", "mogradient", _ours(lambda k, s: mg.harmonizers.GradDrop(seed=s))),
        Spec(
            "MGDA-UB", "mogradient", lambda k, s: OursFeatures(mg.harmonizers.MGDA(normalize=False))
        ),
        Spec("UW", "mogradient", _scalar("uw")),
        Spec("DWA", "mogradient", _scalar("dwa", temperature=DWA_TEMPERATURE)),
        Spec("GLS", "mogradient", _scalar("gls")),
        Spec("IMTL-L", "mogradient", _scalar("imtll")),
        Spec("STCH", "mogradient", _scalar("stch", mu=STCH_MU)),
        Spec("PBI", "mogradient", _scalar("pbi", theta=PBI_THETA)),
        Spec("FAMO", "mogradient", _scalar("famo")),
        Spec(
            "GradNorm",
            "mogradient",
            _scalar_on(_last_shared_layer, "gradnorm", alpha=GRADNORM_ALPHA),
        ),
        Spec("DB-MTL", "mogradient", _scalar_on(_trunk, "dbmtl")),
        Spec("IMTL", "mogradient", _scalar_on(_trunk, "imtl")),
        Spec("MoCo", "mogradient", _scalar_on(_trunk, "moco")),
        Spec("PCD", "mogradient", _ours(lambda k, s: mg.harmonizers.PCD())),
        Spec("COSMOS", "mogradient", _cosmos),
        Spec("TorchJD UPGrad", "torchjd", _tjd("UPGrad")),
        Spec("TorchJD MGDA", "torchjd", _tjd("MGDA")),
        Spec("TorchJD DualProj", "torchjd", _tjd("DualProj")),
        Spec("TorchJD PCGrad", "torchjd", _tjd("PCGrad")),
        Spec("TorchJD ConFIG", "torchjd", _tjd("ConFIG")),
        Spec("TorchJD FairGrad", "torchjd", _tjd("FairGrad", alpha=FAIRGRAD_ALPHA)),
        # n_warmup_steps=1: ours; TorchJD's default 0 updates on the raw, unnormalized estimate.
        Spec("TorchJD ExcessMTL", "torchjd", _tjd("ExcessMTL", n_warmup_steps=1)),
        # TorchJD's Krum scores plain distances, ours the paper's squared ones.
        Spec("TorchJD Krum", "torchjd", _tjd("Krum", n_byzantine=0), min_tasks=3),
        Spec("TorchJD TrimmedMean", "torchjd", _tjd("TrimmedMean", trim_number=1), min_tasks=3),
        Spec("TorchJD GradDrop", "torchjd", _tjd("GradDrop")),
        Spec("TorchJD PCD", "torchjd", _tjd("PCD")),
        # Over TorchJD's MGDAWeighting (Frank-Wolfe, its defaults: epsilon 1e-3, 100 iters),
        # as the TorchJD MGDA row; ours averages the exact min-norm weights. alpha 0.9 both.
        Spec(
            "TorchJD CR-MOGM",
            "torchjd",
            _tjd_gramian(lambda tjd: tjd.CRMOGMWeighting(tjd.MGDAWeighting())),
        ),
        # TorchJD's MoDo and SDMGrad expect J_1 J_2^T from two batches; given J J^T of the
        # one batch they are our single-stack variants. Defaults equal ours (gamma 0.1,
        # rho 0.1; lr 10, momentum 0.5, 20 steps, lambda 0.3); neither draws randomness.
        Spec("TorchJD MoDo", "torchjd", _tjd_gramian(lambda tjd: tjd.MoDoWeighting())),
        Spec("TorchJD SDMGrad", "torchjd", _tjd_gramian(lambda tjd: tjd.SDMGradWeighting())),
        Spec("TorchJD UW", "torchjd", _tjd_scalar(lambda tjd, k: tjd.UW(k))),
        Spec("TorchJD DWA", "torchjd", _tjd_scalar(lambda tjd, k: tjd.DWA(DWA_TEMPERATURE))),
        Spec("TorchJD GLS", "torchjd", _tjd_scalar(lambda tjd, k: tjd.GeometricMean())),
        Spec("TorchJD IMTL-L", "torchjd", _tjd_scalar(lambda tjd, k: tjd.IMTLL(k))),
        Spec("TorchJD STCH", "torchjd", _tjd_scalar(lambda tjd, k: tjd.STCH(mu=STCH_MU))),
        # TorchJD's PBI needs its preferences: uniform, our default.
        Spec(
            "TorchJD PBI",
            "torchjd",
            _tjd_scalar(lambda tjd, k: tjd.PBI(PBI_THETA, weights=torch.full((k,), 1.0 / k))),
        ),
        # Defaults equal ours: lr 0.025, weight_decay 1e-3, min_losses 0.
        Spec("TorchJD FAMO", "torchjd", _tjd_scalar(lambda tjd, k: tjd.FAMO(k))),
        Spec("TorchJD COSMOS", "torchjd", _tjd_cosmos),
        Spec("LibMTL EW", "libmtl", _lib("EW")),
        Spec("LibMTL RLW", "libmtl", _lib("RLW", dist="Normal")),
        Spec("LibMTL MGDA", "libmtl", _lib("MGDA", mgda_gn="none")),
        Spec("LibMTL MGDA-l2", "libmtl", _lib("MGDA", mgda_gn="l2")),
        Spec("LibMTL PCGrad", "libmtl", _lib("PCGrad")),
        Spec("LibMTL GradVac", "libmtl", _lib("GradVac", beta=GRADVAC_BETA)),
        Spec("LibMTL IMTL-G", "libmtl", _lib("IMTL")),
        # LibMTL 1.1.5's CAGrad hard-codes reshape(1, 3): it runs only with three tasks.
        Spec("LibMTL CAGrad", "libmtl", _lib("CAGrad", calpha=CAGRAD_C, rescale=1), only_tasks=3),
        # LibMTL starts the log-variances at -0.5 (hard-coded in its init_param); ours at 0.
        Spec("LibMTL UW", "libmtl", _lib("UW")),
        Spec("LibMTL DWA", "libmtl", _lib("DWA", T=DWA_TEMPERATURE)),
        # LibMTL's GLS reports L_k / (K prod L) as its weights, not the factor its loss
        # gives each gradient, G / (K L_k): the weights plot shows what it reports.
        Spec("LibMTL GLS", "libmtl", _lib("GLS")),
        # LibMTL's GradNorm: equal weights in epoch 0 (whose mean losses are its L(0)), then
        # K softmax(s) with s stepped by the training Adam, norms on all shared parameters.
        Spec("LibMTL GradNorm", "libmtl", _lib("GradNorm", alpha=GRADNORM_ALPHA)),
        # No LibMTL GradDrop: it asserts rep_grad=True (per-task copies of the representation
        # from LibMTL's own model); TorchJD's GradDrop row is the library comparison.
    ]
}


def libmtl_installed() -> bool:
    """LibMTL is optional: the Makefile installs it with --no-deps (it pins torchvision)."""
    # Once loaded, "LibMTL" is our stub package (no __spec__: find_spec would raise).
    return "LibMTL" in sys.modules or importlib.util.find_spec("LibMTL") is not None


def applicable(spec: Spec, num_tasks: int) -> bool:
    """Whether the method runs on K tasks here (LibMTL rows need LibMTL installed)."""
    if spec.library == "libmtl" and not libmtl_installed():
        return False
    return num_tasks >= spec.min_tasks and spec.only_tasks in (None, num_tasks)


def preference_method(kind: str, preference: tuple[float, ...]) -> Method:
    """A point of a Pareto-front sweep: MGDA-NR tilted by ``preference``, or the weighted sum."""
    if kind == "MGDA-NR":
        return Ours(mg.harmonizers.MGDA(preferences=list(preference)))
    if kind == "weighted sum":
        return Ours(mg.harmonizers.FixedWeights(list(preference)))
    raise ValueError(f"unknown sweep {kind!r}; use 'MGDA-NR' or 'weighted sum'")
