"""A small deep Q-network in NumPy, as DeepTM's optimizer uses it (TPDS'24, §IV-C, Table II).

Three dense layers (ReLU, ReLU, linear) map a flattened state to one Q-value per action; a
replay memory of the last ``memory`` transitions feeds minibatches of ``batch``; the loss is the
mean squared difference between Q(s, a) and the Bellman target r + γ·max Q'(s', ·) of a target
network that is synced at every episode (the paper names neither a target network nor the
optimizer nor the layer width: these are the usual DQN choices); the optimizer is Adam, 64
units per hidden layer. Everything draws from one seeded ``numpy.random.Generator``, so the
same seed gives the same weights.
"""

import numpy as np

__all__ = ["QNetwork", "ReplayMemory", "Agent", "exploit_probability"]


def exploit_probability(episode, episodes, start=0.1, ramp=0.75):
    """DeepTM's schedule: the probability of acting greedily on Q rises linearly from start
    (0.1) to 1.0 over the first ``ramp`` share of the episodes (150 of 200), then stays 1."""
    span = max(1, int(round(ramp * episodes)))
    return min(1.0, start + (1.0 - start) * episode / span)


class QNetwork:
    """Dense(inputs→hidden) → ReLU → Dense(hidden→hidden) → ReLU → Dense(hidden→actions)."""

    def __init__(self, inputs, actions, hidden, rng):
        sizes = [inputs, hidden, hidden, actions]
        shapes = [s for a, b in zip(sizes, sizes[1:]) for s in ((a, b), (b,))]
        self.flat = np.zeros(sum(int(np.prod(s)) for s in shapes))
        self.params, at = [], 0
        for shape in shapes:                     # views into one buffer: one Adam update
            size = int(np.prod(shape))
            self.params.append(self.flat[at:at + size].reshape(shape))
            at += size
        for w in self.params[::2]:
            w[...] = rng.normal(0.0, np.sqrt(2.0 / w.shape[0]), size=w.shape)   # He init

    def forward(self, x):
        """Q-values of a batch of states (rows), and the activations backward needs."""
        w1, b1, w2, b2, w3, b3 = self.params
        h1 = np.maximum(x @ w1 + b1, 0.0)
        h2 = np.maximum(h1 @ w2 + b2, 0.0)
        return h2 @ w3 + b3, (x, h1, h2)

    def q(self, x):
        return self.forward(np.atleast_2d(x))[0]

    def gradients(self, cache, dq):
        """Gradients of the parameters given dLoss/dQ (same shape as the Q-values), as one
        flat array laid out like the parameters."""
        x, h1, h2 = cache
        _, _, w2, _, w3, _ = self.params
        d2 = (dq @ w3.T) * (h2 > 0)
        d1 = (d2 @ w2.T) * (h1 > 0)
        parts = [x.T @ d1, d1.sum(0), h1.T @ d2, d2.sum(0), h2.T @ dq, dq.sum(0)]
        return np.concatenate([p.ravel() for p in parts])

    def copy_from(self, other):
        self.flat[...] = other.flat


class Adam:
    """Adam (Kingma & Ba) over one flat parameter array, updated in place."""

    def __init__(self, flat, lr, beta1=0.9, beta2=0.999, eps=1e-8):
        self.lr, self.b1, self.b2, self.eps, self.t = lr, beta1, beta2, eps, 0
        self.m = np.zeros_like(flat)
        self.v = np.zeros_like(flat)

    def step(self, flat, grad):
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        self.m *= self.b1
        self.m += (1 - self.b1) * grad
        self.v *= self.b2
        self.v += (1 - self.b2) * grad * grad
        flat -= self.lr * (self.m / c1) / (np.sqrt(self.v / c2) + self.eps)


class ReplayMemory:
    """The last ``capacity`` transitions (state, action, reward, next state, done)."""

    def __init__(self, capacity, width):
        self.capacity = capacity
        self.s = np.zeros((capacity, width))
        self.s2 = np.zeros((capacity, width))
        self.a = np.zeros(capacity, dtype=np.int64)
        self.r = np.zeros(capacity)
        self.done = np.zeros(capacity, dtype=bool)
        self.size = self.next = 0

    def add(self, s, a, r, s2, done):
        i = self.next
        self.s[i], self.a[i], self.r[i], self.done[i] = s, a, r, done
        if s2 is not None:
            self.s2[i] = s2
        self.next = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def add_reward(self, r):
        """Add r to the latest transition (DeepTM's episode reward joins the last step's)."""
        if self.size:
            self.r[(self.next - 1) % self.capacity] += r

    def sample(self, n, rng):
        idx = rng.integers(0, self.size, size=n)
        return self.s[idx], self.a[idx], self.r[idx], self.s2[idx], self.done[idx]


class Agent:
    """ε-greedy DQN agent: ``act`` picks an action, ``remember`` stores a transition, ``learn``
    takes one Adam step on a minibatch, ``end_episode`` syncs the target network."""

    def __init__(self, inputs, actions=2, hidden=64, lr=1e-4, gamma=0.99, memory=100,
                 batch=32, seed=0):
        self.rng = np.random.default_rng(seed)
        self.actions, self.gamma, self.batch = actions, gamma, batch
        self.net = QNetwork(inputs, actions, hidden, self.rng)
        self.target = QNetwork(inputs, actions, hidden, self.rng)
        self.target.copy_from(self.net)
        self.opt = Adam(self.net.flat, lr)
        self.memory = ReplayMemory(memory, inputs)
        self.updates = 0
        self.losses = []

    def act(self, state, exploit):
        """argmax Q with probability ``exploit``, else a uniformly random action."""
        if self.rng.random() >= exploit:
            return int(self.rng.integers(self.actions))
        return int(np.argmax(self.net.q(state)[0]))

    def remember(self, s, a, r, s2, done):
        self.memory.add(s, a, r, s2, done)

    def learn(self):
        """One minibatch step once the memory holds a batch; returns the loss (or None)."""
        if self.memory.size < self.batch:
            return None
        s, a, r, s2, done = self.memory.sample(self.batch, self.rng)
        q_next = self.target.q(s2).max(axis=1)
        target = r + self.gamma * q_next * (~done)
        q, cache = self.net.forward(s)
        rows = np.arange(len(a))
        err = q[rows, a] - target
        dq = np.zeros_like(q)
        dq[rows, a] = 2.0 * err / len(a)
        self.opt.step(self.net.flat, self.net.gradients(cache, dq))
        self.updates += 1
        loss = float(err @ err) / len(err)
        self.losses.append(loss)
        return loss

    def end_episode(self):
        self.target.copy_from(self.net)
