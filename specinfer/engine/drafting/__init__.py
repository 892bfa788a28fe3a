"""Token trees and the drafts that grow them (SpecInfer Section 3): SSMs and model-free members."""
