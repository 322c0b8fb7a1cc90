"""Closed-form results of queueing theory that the simulator is checked against."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def erlang_c(c: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a = lambda/mu (< c)."""
    rho = offered / c
    top = offered**c / math.factorial(c) / (1 - rho)
    return top / (sum(offered**k / math.factorial(k) for k in range(c)) + top)


def mmc_mean_wait(lam: float, mu: float, c: int) -> float:
    """Mean time in queue (before service) of M/M/c."""
    return erlang_c(c, lam / mu) / (c * mu - lam)


def mm1_sojourn_quantile(lam: float, mu: float, q: float) -> float:
    """M/M/1 FCFS sojourn time is exponential with rate mu - lambda."""
    return -math.log(1 - q) / (mu - lam)


def mmck_blocking(lam: float, mu: float, c: int, k: int) -> float:
    """Probability that an arrival finds an M/M/c/K system full (K = servers + waiting places)."""
    a = lam / mu
    weights = [
        a**n / math.factorial(n) if n <= c else a**n / (math.factorial(c) * c ** (n - c))
        for n in range(k + 1)
    ]
    return weights[k] / sum(weights)


def mmck_wait(lam: float, mu: float, c: int, k: int) -> tuple[float, float]:
    """M/M/c/K, of the arrivals let in (those that find fewer than K in the system): the probability of
    waiting, P(c <= N < K) / (1 - P(N = K)) by PASTA, and the mean wait, L_q / (lambda (1 - P(N = K))) by
    Little's law on the admitted stream, L_q = sum over n > c of (n - c) P(N = n)."""
    a = lam / mu
    weights = [
        a**n / math.factorial(n) if n <= c else a**n / (math.factorial(c) * c ** (n - c))
        for n in range(k + 1)
    ]
    law = [w / sum(weights) for w in weights]
    admitted = 1 - law[k]
    queued = sum((n - c) * p for n, p in enumerate(law) if n > c)
    return sum(law[c:k]) / admitted, queued / (lam * admitted)


def md1_mean_wait(lam: float, service: float) -> float:
    """Pollaczek-Khinchine: mean wait of M/D/1 = rho * D / (2 (1 - rho))."""
    rho = lam * service
    return rho * service / (2 * (1 - rho))


def mm1_mean_wait_variance(lam: float, mu: float, n: int) -> float:
    """Asymptotic variance of the sample mean of n successive M/M/1 waiting times (autocorrelation included).

    Daley (1968) / Whitt (1989): n * Var(mean W_q) -> rho (2 + 5 rho - 4 rho^2 + rho^3) / (mu^2 (1 - rho)^4).
    """
    rho = lam / mu
    return rho * (2 + 5 * rho - 4 * rho**2 + rho**3) / (mu**2 * (1 - rho) ** 4) / n


def mmc_wait_tail(lam: float, mu: float, c: int, t: float) -> float:
    """P(W > t) of the M/M/c FCFS wait: an arrival waits with probability C(c, a), and then an exponential
    time of rate c mu - lambda (the rate at which the queue ahead of it empties)."""
    return erlang_c(c, lam / mu) * math.exp(-(c * mu - lam) * t)


def mmc_wait_quantile(lam: float, mu: float, c: int, q: float) -> float:
    """The q-quantile of the M/M/c wait: 0 when at least a share q of arrivals do not wait."""
    waits = erlang_c(c, lam / mu)
    return 0.0 if waits <= 1 - q else math.log(waits / (1 - q)) / (c * mu - lam)


def mg1_mean_wait(lam: float, mean: float, second_moment: float) -> float:
    """Pollaczek-Khinchine: mean wait of M/G/1 = lambda E[S^2] / (2 (1 - rho)), rho = lambda E[S]."""
    return lam * second_moment / (2 * (1 - lam * mean))


def gm1_sigma(laplace: Callable[[float], float], mu: float) -> float:
    """G/M/1: the root sigma in (0, 1) of sigma = A*(mu (1 - sigma)), A* the Laplace-Stieltjes transform of
    the inter-arrival time (rho < 1). An arrival waits with probability sigma, and then an exponential time of
    rate mu (1 - sigma); the mean wait is sigma / (mu (1 - sigma)). Found by bisection: the gap
    A*(mu (1 - x)) - x is positive at 0 and negative just below 1."""
    lo, hi = 0.0, 1 - 1e-9
    for _ in range(200):
        mid = (lo + hi) / 2
        if laplace(mu * (1 - mid)) > mid:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def gamma_laplace(lam: float, cv: float) -> Callable[[float], float]:
    """Laplace-Stieltjes transform of a gamma inter-arrival time of mean 1/lambda and coefficient of
    variation cv: (k lambda / (k lambda + s))^k with shape k = 1 / cv^2."""
    k = 1 / cv**2
    return lambda s: (k * lam / (k * lam + s)) ** k


def mm1_deterministic_patience(lam: float, mu: float, patience: float) -> tuple[float, float]:
    """M/M/1 FCFS where each customer gives up `patience` after arriving, and one already in service is
    served to the end all the same (the server's time is lost with it).

    The server sees M/M/1+D: an arrival is served iff its offered wait V (the work ahead of it) is below
    the patience T. V has an atom p0 at 0 and density p0 lambda e^{-(mu - lambda) x} below T, p0 lambda
    e^{-(mu - lambda) T} e^{-mu (x - T)} above it (level crossing), p0 from the total mass. Returns (the share
    never served, P(V >= T) = p0 lambda e^{-(mu - lambda) T} / mu; the share without an answer by T, which
    adds those served too late: P(V + S > T) = P(V >= T) + p0 e^{-(mu - lambda) T}).
    """
    d = mu - lam
    decay = math.exp(-d * patience)
    growth = patience if d == 0 else (1 - decay) / d
    p0 = 1 / (1 + lam * growth + lam * decay / mu)
    never = p0 * lam * decay / mu
    return never, never + p0 * decay


def erlang_b(c: int, offered: float) -> float:
    """Probability that an arrival finds all c servers of an M/M/c/c loss system busy (offered load a)."""
    blocked = 1.0
    for k in range(1, c + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return blocked


def retrial_blocking(c: int, offered: float, retries: int) -> float:
    """Share of attempts refused by an M/M/c/c loss system whose refused customers try again, up to `retries`
    times, after delays long and spread enough that the retries mix into a Poisson stream (independent
    displacements of a point process tend to a Poisson process): each attempt is refused with the same
    probability b, a customer makes 1 + b + ... + b^retries attempts on average, and b solves
    b = Erlang B(c, a (1 + b + ... + b^retries)), found by iterating from b = Erlang B(c, a)."""
    blocked = erlang_b(c, offered)
    for _ in range(500):
        blocked = erlang_b(c, offered * sum(blocked**k for k in range(retries + 1)))
    return blocked


def mdc_number_in_system(lam: float, service: float, c: int, n_max: int = 400) -> list[float]:
    """The stationary law of the number in an M/D/c system (Crommelin, 1932): what is in the system at t + D
    is what was there at t less the c served meanwhile (every one in service at t has left by t + D, and
    the c oldest waiting have started), plus the Poisson(lambda D) arrivals of (t, t + D]. So N(t + D) =
    max(N(t) - c, 0) + A for any t, and the law of N solves that balance; it is solved on 0..n_max - 1
    (beyond, the law is negligible for the loads checked here), a column of the balance replaced by the
    total mass."""
    a = lam * service
    k = np.arange(n_max)
    pmf = np.exp(-a + k * math.log(a) - np.array([math.lgamma(i + 1) for i in range(n_max)]))
    moves = np.zeros((n_max, n_max))
    for i in range(n_max):
        base = max(i - c, 0)
        moves[i, base:] = pmf[: n_max - base]
    system = (moves - np.eye(n_max)).T
    system[-1, :] = 1.0
    rhs = np.zeros(n_max)
    rhs[-1] = 1.0
    return [float(p) for p in np.linalg.solve(system, rhs)]


def mdc_mean_wait(lam: float, service: float, c: int) -> float:
    """Mean wait of M/D/c, exact: L_q = E[N] - lambda D (the busy servers), W_q = L_q / lambda (Little)."""
    law = mdc_number_in_system(lam, service, c)
    return (sum(n * p for n, p in enumerate(law)) - lam * service) / lam


def mmc_deterministic_patience(lam: float, mu: float, c: int, patience: float) -> tuple[float, float]:
    """M/M/c FCFS where each customer gives up `patience` after arriving and one already in service is
    served to the end (M/M/c+D): `mm1_deterministic_patience` with c servers.

    Below c busy servers the states have the Erlang weights p_n = p0 a^n / n!; above, the offered wait V
    (what an arrival would wait) has density lambda p_{c-1} e^{-(c mu - lambda) x} below T and lambda p_{c-1}
    e^{-(c mu - lambda) T} e^{-c mu (x - T)} above it (level crossing: V drains at rate 1 and an arrival
    that joins adds an exponential time of rate c mu), p0 from the total mass. Returns (the share never
    served, P(V >= T); the share without an answer by T, which adds those served too late: an arrival that
    finds a free server with probability sum p_n and waits V < T otherwise, then is served an exponential
    time of rate mu: P(V >= T) + (sum p_n) e^{-mu T} + int_0^T v(x) e^{-mu (T - x)} dx)."""
    a = lam / mu
    weights = [a**n / math.factorial(n) for n in range(c)]
    d = c * mu - lam
    decay = math.exp(-d * patience)
    growth = patience if d == 0 else (1 - decay) / d
    p0 = 1 / (sum(weights) + lam * weights[-1] * (growth + decay / (c * mu)))
    top = p0 * weights[-1]  # p_{c-1}
    never = lam * top * decay / (c * mu)
    k = (c - 1) * mu - lam
    before = patience if k == 0 else (1 - math.exp(-k * patience)) / k
    late = math.exp(-mu * patience) * (p0 * sum(weights) + lam * top * before)
    return never, never + late
