"""FedLowFreq, a test plugin written from methods/README.md: FedDG, but each client shares one low-frequency amplitude
window per class (the mean over its images of that class of the central (2b+1)^2 window of |FFT2|, zeros for a
class it does not hold) instead of one full spectrum per image: a new kind, ``class_lowfreq_amplitude``. The server
relays the other clients' windows; local training mixes with them through FedDG's ``set_bank`` hook. Nothing else
changes (FedDG's episodic training, FedAvg's rounds)."""
import torch

from fdg_audit.api.method import Reply, register_kind
from fdg_audit.api import load_method

FedDG = load_method("feddg")
KIND = "class_lowfreq_amplitude"
register_kind(KIND)


class Client(FedDG.Client):
    def on_bank(self, msg):
        h, w = self.train.x.shape[-2:]
        b = FedDG.half_window(self.params, h, w)
        win = FedDG.central(FedDG.amplitude(self.train.x), b)          # (N, C, 2b+1, 2b+1)
        k = self.shape[3]
        out = torch.zeros(k, *win.shape[1:])
        for c in range(k):
            sel = self.train.y == c
            if sel.any():
                out[c] = win[sel].mean(0).cpu()
        return Reply(KIND, {"amp": out})

    def on_bank_relay(self, msg):
        # only the rows of classes a source holds
        self.set_bank([a[a.flatten(1).abs().sum(1) > 0] for _, a in sorted(msg.arrays.items())])


class Server(FedDG.Server):
    bank_kind = KIND


class FedLowFreq(FedDG):
    name = "fedlowfreq"
    Server, Client = Server, Client
    kinds = ("n_samples", KIND, "weights")
