"""Optional adapters to training stacks (`offload.integrations.hf`: the Hugging Face Trainer).

Imported only on demand: `import offload` never imports this package, and this
package never imports a framework until one of its modules is imported.
"""
